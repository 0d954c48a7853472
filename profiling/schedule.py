"""The step schedule of docs/design.md#step-semantics, in one place.

Step k is the interval that ends when version k is published: trainer mini-batches producing
version k, rollout generation with weights k-1. A profiling *window* is a run of profiled steps
recorded as one session (one step unless `profile_continuous_steps` merges consecutive ones);
the window is labelled by its first step, and its traces live in `step_<first>/`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from profiling.config import GlobalProfilerConfig


class SyncPlan(BaseModel):
    """What the trainer-side client does at the sync that publishes `version`, in this order."""

    model_config = ConfigDict(frozen=True)

    version: int
    stop_step: int | None = None
    """Window label to stop before the update (None: nothing to stop)."""
    start_step: int | None = None
    """Window label to start after the update (None: nothing to start)."""
    update_inside_window: bool = False
    """The update falls inside a continuous window: it is marked in the trace, not stopped."""

    @property
    def control_calls(self) -> int:
        """Profiling control calls this sync makes (the update itself not counted)."""
        return (self.stop_step is not None) + (self.start_step is not None)


class StepSchedule:
    """Which steps are profiled and which control calls each weight sync makes."""

    def __init__(self, steps: list[int] | None, continuous: bool = False):
        self.steps: tuple[int, ...] = tuple(sorted(set(steps or ())))
        self.continuous = continuous
        self._windows = self._build_windows()
        self._label = {s: w[0] for w in self._windows for s in w}

    @classmethod
    def from_config(cls, cfg: GlobalProfilerConfig) -> StepSchedule:
        return cls(cfg.steps if cfg.tool else None, cfg.profile_continuous_steps)

    def _build_windows(self) -> list[tuple[int, ...]]:
        if not self.continuous:
            return [(s,) for s in self.steps]
        windows: list[list[int]] = []
        for s in self.steps:
            if windows and windows[-1][-1] == s - 1:
                windows[-1].append(s)
            else:
                windows.append([s])
        return [tuple(w) for w in windows]

    @property
    def windows(self) -> list[tuple[int, ...]]:
        """Profiled windows in order: [1,2,5] gives (1,),(2,),(5,), or (1,2),(5,) if continuous."""
        return list(self._windows)

    def is_profiled(self, step: int) -> bool:
        return step in self._label

    def window_label(self, step: int) -> int | None:
        """The label (first step) of the window holding `step`, or None."""
        return self._label.get(step)

    def window_steps(self, label: int) -> tuple[int, ...]:
        """All steps of the window labelled `label`."""
        for w in self._windows:
            if w[0] == label:
                return w
        raise KeyError(f"no profiled window starts at step {label}")

    def begin(self) -> int | None:
        """Window to start at training start (version 0 loaded): step 1's, if profiled."""
        return 1 if self.window_label(1) == 1 else None

    def sync(self, version: int) -> SyncPlan:
        """The plan for the weight sync that publishes `version` (ending step `version`)."""
        ending, next_step = self.window_label(version), self.window_label(version + 1)
        if ending is not None and ending == next_step:
            return SyncPlan(version=version, update_inside_window=True)
        return SyncPlan(
            version=version,
            stop_step=ending,
            start_step=next_step if next_step == version + 1 else None,
        )

    def on_publish(self, version: int, active: list[int] | None) -> SyncPlan:
        """The plan of a server that sees `version` published while the window of steps
        `active` records (None: none), where versions may skip (a client may publish 5 after 3):
        the active window stops when it ends at or before `version` (else the update falls
        inside it), and the window beginning at `version + 1` starts. For consecutive versions
        and the window the schedule started, the same plan as `sync(version)`."""
        inside = active is not None and active[-1] > version
        next_step = self.window_label(version + 1)
        return SyncPlan(
            version=version,
            stop_step=active[0] if active is not None and not inside else None,
            start_step=version + 1 if next_step == version + 1 and not inside else None,
            update_inside_window=inside,
        )
