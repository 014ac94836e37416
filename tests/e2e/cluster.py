"""A real multi-process deployment on loopback for end-to-end tests.

Router, P and RLD (cluster A) and MD (cluster B) run as separate OS
processes (`python -m pddgw serve --role ... --node ...`, pddgw.harness)
from a generated config.toml; the WAN between the clusters is shaped by the
links themselves, and MD is reached through a fault proxy this test process
owns (on a thread of its own), so a test can cut the WAN.  Every process
started here is stopped here, by its pid.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from pddgw.harness.cluster import ClusterToml, free_ports, serve_processes
from pddgw.harness.leaks import wait_until_quiet
from pddgw.harness.proxy import ThreadedProxy

# MD's own engine table: another block size than P and RLD, a smaller pool.
MD_ENGINE = """block_size = 32
num_blocks = 128
max_num_batched_tokens = 256"""


class Cluster:
    SECRET = "e2e-test-secret-0123456789"

    def __init__(self, tmp: Path, policy: str = "", p_engine: str = "", gbps: float = 0.05, server: str = "",
                 wan: str = "", model: str = 'dtype = "float64"', md_engine: str = MD_ENGINE,
                 relay_on_p: bool = False):
        self.tmp = tmp
        self.ports = free_ports(relay_on_p)
        self.proxy = ThreadedProxy(self.ports["md0"])
        toml = ClusterToml(model=model, server="request_timeout_s = 60\nallow_request_steering = true\n" + server,
                           wan="latency_ms = 20.0\n" + (wan or f"gbps = {gbps}"), policy=policy,
                           p_engine=p_engine, md_engine=md_engine, relay_on_p=relay_on_p)
        try:
            self.config = toml.write(tmp / "config.toml", self.ports, self.SECRET, md_dialed=self.proxy.port)
        except BaseException:
            self.proxy.close()
            raise
        self.procs = serve_processes(tmp, self.config, self.ports)
        self.url = f"http://127.0.0.1:{self.ports['router']}"

    def start(self) -> None:
        self.procs.start()

    def restart(self, name: str) -> None:
        """Start a killed node again (same port: its peers' links redial it)."""
        assert self.procs.restart(name), f"{name} is still running"

    def log(self, name: str) -> str:
        return self.procs.log(name)

    def kill(self, name: str) -> None:
        self.procs.kill(name)

    def stop(self) -> None:
        self.procs.stop()
        self.proxy.close()

    async def state(self) -> dict:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/debug/state") as r:
            return await r.json()

    async def wait_idle(self, timeout: float = 20.0) -> dict:
        """Until every reachable node has no block in use and nothing in flight."""
        left, doc, _ = await wait_until_quiet(self.state, timeout)
        if left:
            raise AssertionError(f"nodes still busy: {left}")
        return doc


@pytest.fixture
def fresh(tmp_path):
    """-> make(**Cluster kwargs): a started cluster of its own, stopped after the test."""
    made: list[Cluster] = []

    def make(**kw) -> Cluster:
        c = Cluster(tmp_path, **kw)
        made.append(c)
        c.start()
        return c

    yield make
    for c in made:
        c.stop()
