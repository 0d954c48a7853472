"""Serve's `Request failed.` of a caller's mistake is one WARNING line; a real failure keeps its
ERROR and traceback (serve_app/serve_logs.py)."""

from __future__ import annotations

import logging

import pytest

from serve_app.errors import Conflict, Unavailable
from serve_app.serve_logs import SERVE_LOGGER, quiet_serve_logs


@pytest.fixture
def serve_logger(caplog):
    quiet_serve_logs()
    quiet_serve_logs()  # idempotent: one filter
    logger = logging.getLogger(SERVE_LOGGER)
    assert sum(type(f).__name__ == "RefusalsAsWarnings" for f in logger.filters) == 1
    caplog.set_level(logging.INFO, logger=SERVE_LOGGER)
    return logger


def _fail_with(logger: logging.Logger, exc: Exception) -> None:
    try:
        raise exc
    except Exception:
        logger.exception("Request failed.")  # what Ray Serve's replica wrapper logs


@pytest.mark.parametrize(
    "exc", [ValueError("prompt: 300 tokens exceed the context of 256\n  more"), Conflict("step 3 is not active")]
)
def test_a_refusal_the_caller_caused_is_one_warning_line(serve_logger, caplog, exc):
    _fail_with(serve_logger, exc)
    (record,) = caplog.records
    assert record.levelname == "WARNING" and record.exc_info is None, record
    assert record.getMessage() == f"Request refused ({type(exc).__name__}): {str(exc).splitlines()[0]}"
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize("exc", [RuntimeError("engine died"), Unavailable("no replica answered")])
def test_a_failure_keeps_its_error_and_traceback(serve_logger, caplog, exc):
    _fail_with(serve_logger, exc)
    (record,) = caplog.records
    assert record.levelname == "ERROR" and record.exc_info is not None
    assert "Traceback" in caplog.text
