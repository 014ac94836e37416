"""A real multi-process deployment on loopback for end-to-end tests.

Router, P and RLD (cluster A) and MD (cluster B) run as separate OS
processes (`python -m pddgw serve --role ... --node ...`) from a generated
config.toml; the WAN between the clusters is shaped by the links themselves,
and MD is reached through a TCP proxy this test process owns, so a test can
cut the WAN.  Every process started here is stopped here, by its pid.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from pddgw.bench.common import free_port, pdd_nodes_toml


class TcpProxy:
    """Forwards 127.0.0.1:listen -> 127.0.0.1:target in a thread; `cut()` severs everything."""

    def __init__(self, target: int):
        self.port = free_port()
        self.target = target
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.AbstractServer | None = None
        self.cut_off = False
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", self.port))
        ready.set()
        self._loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            writer.close()
            return
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_w}

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(1 << 16):
                    w.write(data)
                    await w.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                w.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    def cut(self) -> None:
        """The WAN goes dark: open connections drop, new ones are refused."""
        def do() -> None:
            self.cut_off = True
            for w in list(self._writers):
                w.transport.abort()
        self._loop.call_soon_threadsafe(do)

    def heal(self) -> None:
        """The WAN is back: new connections go through again."""
        self._loop.call_soon_threadsafe(setattr, self, "cut_off", False)

    def close(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


# MD's own engine table: another block size than P and RLD, a smaller pool.
MD_ENGINE = """block_size = 32
num_blocks = 128
max_num_batched_tokens = 256"""


class Cluster:
    SECRET = "e2e-test-secret-0123456789"

    def __init__(self, tmp: Path, policy: str = "", p_engine: str = "", gbps: float = 0.05, server: str = "",
                 wan: str = "", model: str = 'dtype = "float64"', md_engine: str = MD_ENGINE):
        self.tmp = tmp
        self.ports = {n: free_port() for n in ("router", "p0", "rld0", "md0")}
        self.proxy = TcpProxy(self.ports["md0"])
        cfg = f'''
[model]
{model}

[engine]
num_blocks = 256
block_size = 16
max_num_batched_tokens = 256

[server]
host = "127.0.0.1"
port = {self.ports["router"]}
request_timeout_s = 60
allow_request_steering = true
{server}

[net]
secret = "{self.SECRET}"
heartbeat_s = 0.5
stripes = 2
dead_after_s = 2.0
request_timeout_s = 10.0

[[net.links]]
name = "wan"
latency_ms = 20.0
{wan or f"gbps = {gbps}"}

[policy]
{policy}

{pdd_nodes_toml(self.ports["p0"], self.ports["rld0"], self.proxy.port, p_engine=p_engine,
                md_engine=md_engine)}'''
        self.config = tmp / "config.toml"
        self.config.write_text(cfg)
        self.procs: dict[str, subprocess.Popen] = {}
        self.url = f"http://127.0.0.1:{self.ports['router']}"

    ROLES = {"md0": "md", "rld0": "rld", "p0": "prefill", "router": "router"}

    def _spawn(self, name: str) -> None:
        args = [sys.executable, "-m", "pddgw", "serve", "--role", self.ROLES[name], "--node", name,
                "--config", str(self.config)]
        if name == "md0":
            args += ["--port", str(self.ports["md0"])]      # the others dial it via the proxy
        log = open(self.tmp / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def restart(self, name: str) -> None:
        """Start a killed node again (same port: its peers' links redial it)."""
        assert self.procs[name].poll() is not None, f"{name} is still running"
        self._spawn(name)

    def start(self) -> None:
        for name in self.ROLES:
            self._spawn(name)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited early:\n{self.log(name)}")
            try:
                with socket.create_connection(("127.0.0.1", self.ports["router"]), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("router did not come up:\n" + self.log("router"))

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-4000:]

    def kill(self, name: str) -> None:
        p = self.procs[name]
        p.kill()
        p.wait(10)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.proxy.close()

    async def state(self) -> dict:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/debug/state") as r:
            return await r.json()

    async def wait_idle(self, timeout: float = 20.0) -> dict:
        """Until every reachable node has no block in use and nothing in flight."""
        deadline = time.monotonic() + timeout
        while True:
            st = await self.state()
            busy = {n: s for n, s in st["nodes"].items() if s.get("healthy") and (
                s["kv_blocks_in_use"] or any(s["inflight"].values()))}
            if not busy and not st["router"]["active_requests"]:
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"nodes still busy: {busy}")
            await asyncio.sleep(0.2)


@pytest.fixture
def fresh(tmp_path):
    """-> make(**Cluster kwargs): a started cluster of its own, stopped after the test."""
    made: list[Cluster] = []

    def make(**kw) -> Cluster:
        c = Cluster(tmp_path, **kw)
        c.start()
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def generate_one_node(prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
    """`pddgw generate` on one node: the invariant's yardstick."""
    import orjson

    out = subprocess.run([sys.executable, "-m", "pddgw", "generate", "--prompt-ids",
                          ",".join(map(str, prompt)), "--max-tokens", str(max_tokens), "--dtype", "float64",
                          "--temperature", str(temperature), "--seed", str(seed), "--json"],
                         capture_output=True, check=True, timeout=120)
    return orjson.loads(out.stdout.splitlines()[-1])["token_ids"]
