"""A CPU engine's thread count is its own thread's: engines of one process each keep theirs."""

from __future__ import annotations

import dataclasses
import os
import threading

import torch

from pddgw.config import Config
from pddgw.core.roles import Role
from pddgw.deploy.serve import embedded_nodes

from .conftest import make_engine, req, run_to_end


def _steps_on_own_thread(engine) -> int:
    """Run the engine to the end on a fresh thread -> that thread's torch thread count after."""
    seen: list[int] = []

    def run() -> None:
        engine.add_request(req("r", [1, 2, 3], 2))
        run_to_end(engine)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return seen[0]


def test_each_engine_steps_with_its_own_thread_count(tiny64):
    before = torch.get_num_threads()
    assert _steps_on_own_thread(make_engine(tiny64, cpu_threads=2)) == 2
    assert _steps_on_own_thread(make_engine(tiny64, cpu_threads=1)) == 1
    assert torch.get_num_threads() == before          # the caller's count is untouched


def test_every_embedded_engine_steps_on_every_core():
    cores = len(os.sched_getaffinity(0))
    threads = {n.name: (n.engine or Config().engine).cpu_threads for n in embedded_nodes(Config())
               if n.role != Role.ROUTER}
    assert threads == {"p0": max(1, cores), "rld0": max(1, cores), "md0": max(1, cores)}
    many = Config(engine=dataclasses.replace(Config().engine, cpu_threads=cores + 3))
    assert {n.name: n.engine.cpu_threads for n in embedded_nodes(many) if n.engine} == \
        {"p0": cores + 3, "rld0": cores + 3, "md0": cores + 3}
    default = Config(engine=dataclasses.replace(Config().engine, cpu_threads=0))
    assert {n.name: n.engine.cpu_threads for n in embedded_nodes(default) if n.engine} == \
        {"p0": 0, "rld0": 0, "md0": 0}
    md = next(n for n in embedded_nodes(Config()) if n.name == "md0")
    assert md.engine.block_size == 2 * Config().engine.block_size
