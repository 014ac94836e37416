"""structlog set-up, done once per process by the CLI and benchmarks."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _StderrLogger:
    """Writes each rendered line to whatever `sys.stderr` is at that moment.

    structlog's PrintLogger binds the stream when a logger is created; a
    cached logger then keeps writing to a stream that was replaced and closed
    (test capture, daemonisation) and the failing write surfaces inside
    unrelated callbacks.
    """

    def msg(self, message: str) -> None:
        stream = sys.stderr
        if stream is not None and not stream.closed:
            print(message, file=stream, flush=True)

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


def _factory(*args: Any) -> _StderrLogger:
    return _StderrLogger()


def setup_logging(level: str = "info", json: bool = False) -> None:
    """Console renderer (coloured on a terminal), JSON lines with `json=True`."""
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        processors += [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    else:
        processors += [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=_factory,
        cache_logger_on_first_use=True,
    )
