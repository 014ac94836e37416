"""Logging keeps working when the process's stderr is replaced (and the old one closed)."""

import io
import sys

import structlog

from pddgw.logs import setup_logging


def test_log_lines_follow_the_current_stderr(monkeypatch):
    setup_logging("info", json=True)
    log = structlog.get_logger("t")
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    log.info("one", k=1)
    first.close()                                  # e.g. a finished test's capture
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    log.warning("two", k=2)
    assert '"event": "two"' in second.getvalue() and '"k": 2' in second.getvalue()
    structlog.reset_defaults()
