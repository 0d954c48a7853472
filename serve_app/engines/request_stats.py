"""Request accounting of one replica over a profiling window (docs/analysis.md#rl-step-breakdown):
requests and tokens served, the slowest requests, the weight versions served, and the time spent
generating (a request in flight, admission open), held (admission held) or idle.

Every method runs on the replica's event loop, where requests enter and finish and where the
engine is paused and resumed, so nothing here takes a lock. Each request costs O(1) work plus a
push onto a heap of at most `slowest` entries.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable

from profiling.step_stats import SLOWEST_KEPT, RequestStats, SlowRequest


class RequestAccounting:
    """The replica's state clock (generating / held / idle) and its window's request counts."""

    def __init__(self, slowest: int = SLOWEST_KEPT, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._keep = slowest
        self._in_flight = 0
        self._paused = False
        self._since = clock()
        self._open_at: float | None = None
        """The monotonic time the window opened (None: no window open)."""
        self._reset()

    def _reset(self) -> None:
        self._seconds = {"generating": 0.0, "held": 0.0, "idle": 0.0}
        self._requests = self._failed = self._prompt_tokens = self._output_tokens = 0
        self._versions: dict[int, int] = {}
        self._slow: list[tuple[float, int, SlowRequest]] = []  # min-heap on latency
        self._seq = 0

    # -- the window ------------------------------------------------------------------------------
    def open(self) -> None:
        """A profiling window starts: count from zero."""
        self._settle()
        self._reset()
        self._open_at = self._clock()
        self._wall_open = time.time()

    def close(self) -> RequestStats | None:
        """The window ends: its figures (None: no window was open)."""
        if self._open_at is None:
            return None
        self._settle()
        window = self._clock() - self._open_at
        self._open_at = None
        slowest = [s for _, _, s in sorted(self._slow, key=lambda x: (-x[0], x[1]))]
        return RequestStats(
            started_at=self._wall_open,
            stopped_at=time.time(),
            window_s=round(window, 6),
            generating_s=round(self._seconds["generating"], 6),
            held_s=round(self._seconds["held"], 6),
            idle_s=round(self._seconds["idle"], 6),
            requests=self._requests,
            failed=self._failed,
            prompt_tokens=self._prompt_tokens,
            output_tokens=self._output_tokens,
            weight_versions=dict(sorted(self._versions.items())),
            slowest=slowest,
        )

    @property
    def in_flight(self) -> int:
        """Requests in the engine now (entered, not finished)."""
        return self._in_flight

    # -- events ----------------------------------------------------------------------------------
    def paused(self, paused: bool) -> None:
        """Admission was held (True) or opened again (False)."""
        self._settle()
        self._paused = paused

    def entered(self) -> float:
        """A request entered the engine; returns the token to pass to `finished`."""
        self._settle()
        self._in_flight += 1
        return self._clock()

    def finished(
        self, entered_at: float, prompt_tokens: int, output_tokens: int | None, versions: Iterable[int] = ()
    ) -> None:
        """The request that entered at `entered_at` finished (`output_tokens` None: it failed)."""
        self._settle()
        self._in_flight -= 1
        if self._open_at is None:
            return
        if output_tokens is None:
            self._failed += 1
            return
        self._requests += 1
        self._prompt_tokens += prompt_tokens
        self._output_tokens += output_tokens
        served = sorted(set(versions))
        for v in served:
            self._versions[v] = self._versions.get(v, 0) + 1
        latency = self._clock() - entered_at
        if len(self._slow) < self._keep or (self._slow and latency > self._slow[0][0]):
            self._seq += 1
            item = (
                latency,
                self._seq,
                SlowRequest(
                    latency_s=round(latency, 6),
                    prompt_tokens=prompt_tokens,
                    output_tokens=output_tokens,
                    weight_versions=served,
                    finished_at=time.time(),
                ),
            )
            if len(self._slow) < self._keep:
                heapq.heappush(self._slow, item)
            else:
                heapq.heapreplace(self._slow, item)

    # -- internals -------------------------------------------------------------------------------
    def _settle(self) -> None:
        """Credit the time since the last event to the state the replica was in."""
        now = self._clock()
        if self._open_at is not None:
            state = "held" if self._paused else "generating" if self._in_flight else "idle"
            self._seconds[state] += now - max(self._since, self._open_at)
        self._since = now
