"""The one thread of an engine on which every profiling-session call runs.

torch.profiler records per thread and must be stopped on the thread that started it, and the
session is not thread-safe, so every profiler call goes through here. An engine whose forward
passes run in this process (the embedded engine) runs them here too, as `step`: control tasks
then run between engine steps, before the next step, which is what makes "admit no new engine
step" exact. An engine that schedules its own steps elsewhere (vLLM, SGLang) has no `step`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

IDLE_INTERVAL_S = 0.2
"""`idle` runs at least this often (the recording's max_duration_s cap is checked there)."""


class ControlThread:
    def __init__(self, step: Callable[[], bool] | None, idle: Callable[[], None], name: str = "engine-control"):
        """`step` runs one engine step and returns False when there was nothing to do (None:
        this engine runs no step here); `idle` runs at least every IDLE_INTERVAL_S."""
        self._step = step
        self._idle = idle
        self._tasks: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._cv = threading.Condition()
        self._admitting = True
        self._running = True
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on this thread before the next engine step."""
        fut: Future[T] = Future()
        with self._cv:
            if not self._running:
                fut.set_exception(RuntimeError("the engine's control thread is shut down"))
                return fut
            self._tasks.append((fn, fut))
            self._cv.notify()
        return fut

    def wake(self) -> None:
        """New engine work arrived."""
        with self._cv:
            self._cv.notify()

    def admit(self, admitting: bool) -> None:
        """Open or close admission of engine steps (control tasks run either way)."""
        self._admitting = admitting
        if admitting:
            self.wake()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._running = False
            self._cv.notify()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        last_idle = 0.0
        while True:
            with self._cv:
                task = self._tasks.popleft() if self._tasks else None
                if task is None and not self._running:
                    return
            if task is not None:
                fn, fut = task
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)
                continue
            worked = self._admitting and self._step is not None and self._step()
            now = time.monotonic()
            if now - last_idle >= IDLE_INTERVAL_S or not worked:
                self._idle()
                last_idle = now
            if not worked:
                with self._cv:
                    if not self._tasks and self._running:
                        self._cv.wait(IDLE_INTERVAL_S)

