"""Every test starts with the structlog configuration the session started with.

The commands' mains (`pddgw sim`, `pddgw plan`, ...) call `setup_logging`, which configures
structlog process-wide: a test that runs one in-process would otherwise leave its level filter to
every later test, and `structlog.testing.capture_logs` would capture nothing below it.
"""

from __future__ import annotations

import pytest
import structlog


@pytest.fixture(autouse=True)
def _structlog_restored():
    before = structlog.get_config()
    yield
    structlog.configure(**before)
