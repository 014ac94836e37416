"""A deployment under test, on this event loop: its processes, the WAN proxy in front of md0, their RSS.

`Deployment(directory, toml)` is the 4-process PDD deployment of `toml` with md0 behind a
`FaultProxy`; `Deployment(directory, None, dtype)` one `pddgw serve` process.  `start()`,
faults, `sample_rss`, `stop()`.  A fault schedule is comma-separated
`SECONDS:ACTION=TARGET[@ARG]` items from the start of the load (`parse_faults`; `OptionError`
names a bad one):
     kill=NODE[@S]   SIGKILL worker NODE (p0, rld0, md0); with @S start it again S seconds later
     restart=NODE    start a killed worker again (waits for its /health)
     sigterm=NODE    graceful restart: SIGTERM worker NODE (it drains within `[server]
                     drain_timeout_s`), start it again once it exited (waits for its /health)
     cut=wan         the WAN goes dark: open connections drop, new ones are refused
     slow=wan@MBPS   bandwidth collapse: the proxy forwards at most MBPS megabit/s each way
     heal=wan        the WAN back (undoes cut and slow)
   e.g. "10:kill=rld0@5,20:cut=wan,25:heal=wan,30:slow=wan@2,40:heal=wan".

`apply_faults` applies each fault when due; every action and restart becomes a `FaultRecord`
(on the load's clock and the logs' UTC clock).  Restarts run as tasks in `pending`.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pddgw.harness.cluster import WORKERS, ClusterToml, free_ports, serve_processes
from pddgw.harness.launch import Processes
from pddgw.harness.ports import free_port
from pddgw.harness.proxy import FaultProxy


@dataclass(frozen=True, slots=True)
class ProcRss:
    pid: int | None                     # the last incarnation's
    start_kb: int | None                # after the warm-up; a restarted node: once healthy again
    end_kb: int | None                  # once quiet (None: not running)
    growth_kb: int | None
    kills: int
    restarts: int
    exit_code: int | None               # None: still running at the end (-9: SIGKILLed here)


class Deployment:
    def __init__(self, directory: Path, toml: ClusterToml | None, dtype: str = "float64"):
        self.dir = directory
        self.toml = toml
        self.dtype = dtype              # the embedded process's (the 4-process one's is in `toml`)
        self.procs = Processes(directory)
        self.proxy: FaultProxy | None = None
        self.router_port = 0
        self.rss_start_kb: dict[str, int | None] = {}    # after warm-up (after its restart, if restarted)
        self.rss_end_kb: dict[str, int | None] = {}
        self.exit_codes: dict[str, int | None] = {}      # at the end, before the stop

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    async def start(self, timeout_s: float = 180.0) -> None:
        if self.toml is None:
            self.router_port = free_port()
            self.procs.add("embedded", ["serve", "--model", "tiny", "--host", "127.0.0.1", "--port",
                                        str(self.router_port), "--dtype", self.dtype], self.router_port)
        else:
            ports = free_ports()
            self.router_port = ports["router"]
            self.proxy = FaultProxy(ports["md0"])
            await self.proxy.start()
            config = self.toml.write(self.dir / "config.toml", ports, md_dialed=self.proxy.port)
            self.procs = serve_processes(self.dir, config, ports)
        for name in self.procs.nodes:
            self.procs.spawn(name)
        await self.procs.wait_ready_async(timeout_s=timeout_s)

    async def kill(self, name: str) -> int | None:
        """SIGKILL by pid -> the pid (None: it was not running)."""
        return await asyncio.to_thread(self.procs.kill, name)

    async def sigterm(self, name: str, timeout_s: float) -> float | None:
        """SIGTERM by pid and wait for the exit -> seconds it took (None: it was not running);
        RuntimeError when it is still running after `timeout_s` (then SIGKILLed)."""
        node = self.procs.nodes[name]
        if not node.alive:
            return None
        assert node.proc is not None
        t0 = time.monotonic()
        node.proc.terminate()
        try:
            await asyncio.to_thread(node.proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            await self.kill(name)
            raise RuntimeError(f"{name} still ran {timeout_s:g} s after SIGTERM (SIGKILLed)") from None
        return time.monotonic() - t0

    async def restart(self, name: str, timeout_s: float = 120.0) -> bool:
        """Start a dead node again and wait for its /health (-> True), or nothing when it runs (-> False)."""
        if not self.procs.restart(name):
            return False
        await self.procs.wait_ready_async([name], timeout_s)
        self.rss_start_kb[name] = self.procs.rss_kb(name)
        return True

    def sample_rss(self, end: bool) -> None:
        for name, node in self.procs.nodes.items():
            if end:
                self.rss_end_kb[name] = self.procs.rss_kb(name)
                self.exit_codes[name] = node.returncode
            else:
                self.rss_start_kb[name] = self.procs.rss_kb(name)

    def rss(self) -> dict[str, ProcRss]:
        """Per process: its last pid, RSS after the warm-up and at the end, kills, restarts, exit code."""
        out = {}
        for name, node in self.procs.nodes.items():
            start, end = self.rss_start_kb.get(name), self.rss_end_kb.get(name)
            out[name] = ProcRss(node.proc.pid if node.proc else None, start, end,
                                None if start is None or end is None else end - start, node.kills,
                                node.restarts, self.exit_codes.get(name))
        return out

    async def stop(self) -> None:
        """SIGTERM every live process (router first), SIGKILL what has not exited after 10 s."""
        await asyncio.to_thread(self.procs.stop)
        if self.proxy is not None:
            await self.proxy.close()


class OptionError(ValueError):
    """A bad option value; the message names it."""


# ---- faults on a schedule ----------------------------------------------------------

WAN = "wan"
ACTIONS = ("kill", "restart", "sigterm", "cut", "slow", "heal")


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float
    action: str           # one of ACTIONS
    target: str           # a worker node or "wan"
    arg: float | None     # kill: restart after this many s; slow: megabit/s

    def __str__(self) -> str:
        arg = "" if self.arg is None else f"@{self.arg:g}"
        return f"{self.at_s:g}:{self.action}={self.target}{arg}"


def parse_faults(text: str) -> list[Fault]:
    """`SECONDS:ACTION=TARGET[@ARG],...` -> faults sorted by time; OptionError names the bad item."""
    out: list[Fault] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        try:
            when, rest = item.split(":", 1)
            action, target = rest.split("=", 1)
            target, _, arg_s = target.partition("@")
            at_s = float(when)
            arg = float(arg_s) if arg_s else None
        except ValueError:
            raise OptionError(f"--faults: {item!r} is not SECONDS:ACTION=TARGET[@ARG]") from None
        action, target = action.strip(), target.strip()
        if at_s < 0:
            raise OptionError(f"--faults: {item!r}: the time must be >= 0")
        if action not in ACTIONS:
            raise OptionError(f"--faults: {item!r}: the action must be one of {', '.join(ACTIONS)}")
        if action in ("kill", "restart", "sigterm"):
            if target not in WORKERS:
                raise OptionError(f"--faults: {item!r}: {action} takes a worker node ({', '.join(WORKERS)})")
            if action in ("restart", "sigterm") and arg is not None:
                raise OptionError(f"--faults: {item!r}: {action} takes no @ARG")
            if arg is not None and arg < 0:
                raise OptionError(f"--faults: {item!r}: the restart delay must be >= 0")
        else:
            if target != WAN:
                raise OptionError(f"--faults: {item!r}: {action} takes the target 'wan'")
            if action == "slow" and (arg is None or arg <= 0):
                raise OptionError(f"--faults: {item!r}: slow needs @MBPS > 0")
            if action != "slow" and arg is not None:
                raise OptionError(f"--faults: {item!r}: {action} takes no @ARG")
        out.append(Fault(at_s, action, target, arg))
    return sorted(out, key=lambda f: f.at_s)


@dataclass(frozen=True, slots=True)
class FaultRecord:
    fault: str
    at_s: float | None                  # when it was applied (s from the start of the load); None: skipped
    note: str
    utc: str | None = None              # the same moment on the node logs' clock


def utc(unix_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(unix_s)) + f".{int(unix_s % 1 * 1e6):06d}Z"


async def apply_faults(faults: Sequence[Fault], dep: Deployment, t0: float, drain_timeout_s: float,
                       records: list[FaultRecord], pending: list[asyncio.Task[None]]) -> None:
    """Each fault when due (loop time `t0` + its seconds); a sigterm's exit is bounded by
    `drain_timeout_s` + 20 s."""
    loop = asyncio.get_running_loop()
    unix0 = time.time() - (loop.time() - t0)

    def record(label: str, at: float, note: str) -> None:
        records.append(FaultRecord(label, round(at, 2), note, utc(unix0 + at)))

    async def restart(f: Fault, label: str, delay: float) -> None:
        await asyncio.sleep(delay)
        at = loop.time() - t0
        try:
            started = await dep.restart(f.target)
            note = (f"healthy again after {loop.time() - t0 - at:.1f} s" if started else "was running")
        except RuntimeError as e:
            note = f"restart failed: {e}"[:500]
        record(label, at, note)

    async def graceful(f: Fault) -> None:
        at = loop.time() - t0
        bound = drain_timeout_s + 20.0
        try:
            secs = await dep.sigterm(f.target, bound)
        except RuntimeError as e:
            record(str(f), at, str(e)[:500])
            return
        if secs is None:
            record(str(f), at, "was not running")
            return
        record(str(f), at, f"SIGTERM: exited after {secs:.1f} s (drain bound {drain_timeout_s:g} s)")
        await restart(f, f"(restart {f.target} after sigterm at {f.at_s:g})", 0.0)

    for f in faults:
        await asyncio.sleep(max(0.0, t0 + f.at_s - loop.time()))
        at = loop.time() - t0
        if f.action == "kill":
            pid = await dep.kill(f.target)
            note = "was not running" if pid is None else f"SIGKILL pid {pid}"
            record(str(f), at, note)
            if f.arg is not None:
                pending.append(asyncio.create_task(restart(f, f"(restart {f.target} after kill at {f.at_s:g})",
                                                           f.arg)))
        elif f.action == "restart":
            pending.append(asyncio.create_task(restart(f, str(f), 0.0)))
        elif f.action == "sigterm":
            pending.append(asyncio.create_task(graceful(f)))
        else:
            assert dep.proxy is not None
            if f.action == "cut":
                dep.proxy.cut()
                note = "WAN cut"
            elif f.action == "slow":
                dep.proxy.slow(f.arg or 0.0)
                note = f"WAN at {f.arg:g} Mbit/s each way"
            else:
                dep.proxy.heal()
                note = "WAN healed"
            record(str(f), at, note)
