"""What the app's Serve processes log, read as users read it: an ERROR line is a failure.

Ray Serve logs every exception a deployment method raises as `Request failed.` at ERROR, with
its traceback. The app's replicas and controller raise on purpose for what a caller got wrong
(a prompt over the context, a stop of a step that is not active: a ValueError, or a ControlError
under 500), which the ingress answers as a 4xx; those become one WARNING line each. Kineto's
probe and thread lines are kept out of stderr as the main job keeps them (`quiet_kineto_env`).
"""

from __future__ import annotations

import logging
import re
import threading

from profiling.backends.torch_profiler import quiet_kineto_env
from serve_app.errors import ControlError

SERVE_LOGGER = "ray.serve"
"""The logger Ray Serve's replica wrapper writes `Request failed.` to."""
_FAILED = "Request failed."
_ACCESS_ERROR = re.compile(r" ERROR (\S+ms)$")
"""The status of a failed call in Serve's access-log line (`CALL <method> ERROR 3.7ms`)."""


def caller_caused(exc: BaseException | None) -> bool:
    """Whether `exc` is a refusal of what a caller asked (the ingress answers it with a 4xx)."""
    if isinstance(exc, ControlError):
        return exc.status < 500
    return isinstance(exc, ValueError)


class RefusalsAsWarnings(logging.Filter):
    """Turns Serve's `Request failed.` of a caller-caused refusal into one WARNING line, and the
    access-log line that follows it (`CALL <method> ERROR <ms>`, at INFO) into `... REFUSED ...`."""

    def __init__(self) -> None:
        super().__init__()
        # Serve logs the access line right after `Request failed.`, on the same thread, with no
        # await between: the refusal of this thread's last record is the one it reports.
        self._refused = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.levelno >= logging.ERROR and record.msg == _FAILED and caller_caused(exc):
            lines = str(exc).strip().splitlines()
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = "Request refused (%s): %s", (type(exc).__name__, lines[0] if lines else "")
            record.exc_info, record.exc_text = None, None
            self._refused.pending = True
        elif getattr(record, "serve_access_log", False):
            if getattr(self._refused, "pending", False) and isinstance(record.msg, str):
                record.msg = _ACCESS_ERROR.sub(r" REFUSED \1", record.msg)
            self._refused.pending = False
        return True


def quiet_serve_logs() -> None:
    """In this Serve process (a replica, the controller): refusals as warnings, Kineto quiet
    (before the first profiler start, when Kineto reads its level). Idempotent."""
    quiet_kineto_env()
    logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, RefusalsAsWarnings) for f in logger.filters):
        logger.addFilter(RefusalsAsWarnings())
