"""Server-side bounds on what a caller may ask for: the options of a `/profile/start`
(`start_limits`) and the size of generation requests (`request_limits`). Each refusal is a 4xx
naming the field, its limit and the key that raises it; nothing else changes."""

from __future__ import annotations

from pydantic import Field

from profiling.config import ProfileOptions, StrictModel


class StartLimits(StrictModel):
    """The most a `/profile/start` may ask for (422 above it). The app's own `profiler`
    settings must stay within these too: a caller cannot stretch a window, or make its trace
    and finalize heavier, beyond what the operator allowed."""

    max_duration_s: float = Field(3600.0, gt=0)
    """Longest window a start may ask for, in seconds (`max_duration_s` null asks for no bound
    and is refused)."""
    max_forward_steps: int | None = Field(100_000, ge=1)
    """Most engine steps a window may record; null: a start may ask for any number, or none."""
    max_trace_mb: float | None = Field(8192.0, gt=0, allow_inf_nan=False)
    """Largest trace budget (`max_trace_mb`) a window may ask for, in MiB of trace JSON; null: a
    start may ask for any budget, or none."""
    record_shapes: bool = True
    """Whether a start may turn record_shapes on."""
    with_stack: bool = False
    """Whether a start may turn with_stack on (Python stacks make traces and finalize many times
    larger)."""
    with_memory: bool = False
    """Whether a start may turn with_memory on."""

    def problems(self, options: ProfileOptions) -> list[str]:
        """Why `options` exceed these limits (empty: they do not)."""
        found = []
        if options.max_duration_s is None or options.max_duration_s > self.max_duration_s:
            found.append(
                f"max_duration_s {options.max_duration_s} exceeds start_limits.max_duration_s {self.max_duration_s}"
            )
        if self.max_forward_steps is not None and (
            options.max_forward_steps is None or options.max_forward_steps > self.max_forward_steps
        ):
            found.append(
                f"max_forward_steps {options.max_forward_steps} exceeds start_limits.max_forward_steps "
                f"{self.max_forward_steps}"
            )
        if self.max_trace_mb is not None and (options.max_trace_mb is None or options.max_trace_mb > self.max_trace_mb):
            found.append(
                f"max_trace_mb {options.max_trace_mb} exceeds start_limits.max_trace_mb {self.max_trace_mb}"
            )
        for flag in ("record_shapes", "with_stack", "with_memory"):
            if getattr(options, flag) and not getattr(self, flag):
                found.append(f"{flag} is not allowed by start_limits.{flag}")
        return found


class RequestLimits(StrictModel):
    """Bounds on generation requests, checked before anything is tokenized or queued."""

    max_body_bytes: int = Field(8 * 2**20, ge=1024)
    """Largest request body, in bytes (413 above it)."""
    max_prompts: int = Field(64, ge=1)
    """Most prompts in one completion request (422 above it)."""
    max_choices: int = Field(256, ge=1)
    """Most choices in one request, prompts times `n` (422 above it)."""
    max_prompt_chars: int = Field(262_144, ge=1)
    """Longest text prompt, in characters, checked before tokenizing (422 above it); the
    tokenized prompt must also leave room for max_tokens in the model's context."""
    max_ongoing_requests: int = Field(256, ge=1)
    """Generation calls one replica runs at once (its engine's batch); more wait in the replica's
    queue. A request's prompts go to the replicas in at most one call per replica."""
    max_queued_requests: int = Field(4096, ge=1)
    """Generation calls that may wait in each replica's queue, in arrival order; more are answered
    503 with Retry-After. RL rollouts (GRPO groups, agent loops) keep thousands in flight."""
    queue_timeout_s: float = Field(600.0, gt=0)
    """Longest a generation call waits in a replica's queue before it is answered 503 with
    Retry-After: a bound no client header can lift."""
