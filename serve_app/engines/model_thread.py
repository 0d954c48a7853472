"""The one thread that runs the model: control tasks and engine steps, never concurrently.

torch.profiler records per thread and must be stopped on the thread that started it, so every
profiler call and every forward pass goes through here. Control tasks run between engine steps,
before the next step, which is what makes "pause admission of new engine steps" exact.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class ModelThread:
    def __init__(self, step: Callable[[], bool], idle: Callable[[], None], name: str = "model"):
        """`step` runs one engine step and returns False when there was nothing to do;
        `idle` runs at least every `idle_interval_s` (watchdogs)."""
        self._step = step
        self._idle = idle
        self._tasks: deque[tuple[Callable[[], Any], Future]] = deque()
        self._cv = threading.Condition()
        self._paused_until: float | None = None
        self._running = True
        self.idle_interval_s = 0.2
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- any thread --------------------------------------------------------------------------
    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the model thread before the next engine step."""
        fut: Future[T] = Future()
        with self._cv:
            if not self._running:
                fut.set_exception(RuntimeError("model thread is shut down"))
                return fut
            self._tasks.append((fn, fut))
            self._cv.notify()
        return fut

    def wake(self) -> None:
        """New engine work arrived."""
        with self._cv:
            self._cv.notify()

    @property
    def paused(self) -> bool:
        return self._paused_until is not None

    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._running = False
            self._cv.notify()
        self._thread.join(timeout)

    # -- model thread (or any: simple assignments) ------------------------------------------
    def pause(self, timeout_s: float) -> None:
        """Admit no engine step until resume(), or until `timeout_s` passes (a safety net for a
        trainer that dies between stop and update)."""
        self._paused_until = time.monotonic() + timeout_s

    def resume(self) -> None:
        self._paused_until = None
        self.wake()

    # -- loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        last_idle = time.monotonic()
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
            if self._paused_until is not None and time.monotonic() >= self._paused_until:
                log.warning("admission hold expired without a weight update or start; resuming")
                self._paused_until = None
            worked = self._paused_until is None and self._step()
            now = time.monotonic()
            if now - last_idle >= self.idle_interval_s or not worked:
                self._idle()
                last_idle = now
            if not worked:
                with self._cv:
                    if not self._tasks and self._running:
                        self._cv.wait(self.idle_interval_s)
