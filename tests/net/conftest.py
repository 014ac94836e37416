"""tests/net: every async test runs on both asyncio's default loop and uvloop
(production uses uvloop; they differ in how a taken-over transport reads)."""

from __future__ import annotations

import asyncio

import uvloop


def pytest_asyncio_loop_factories(config, item):  # noqa: ARG001 - pytest-asyncio hook
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
