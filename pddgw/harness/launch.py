"""`python -m pddgw ...` processes on loopback, owned by the one `Processes` that started them.

A node may run another command instead (`add(..., command=...)`, e.g. vLLM's server for a
benchmark); it is started, waited for and stopped the same way.

Lifecycle of a node (a name, its arguments and the port its /health answers on):

1. `add(name, args, port)` declares it; nothing runs yet.
2. `spawn(name)` starts it (stdout and stderr to `<dir>/<name>.log`, stdin
   closed); `start()` spawns every node in the order they were added
   and waits until each answers GET /health with 200 (`wait_ready`, or
   `wait_ready_async` on an event loop); a node that exits first fails the
   wait with its log.
3. `kill(name)` SIGKILLs it by pid; `restart(name)` spawns a dead node again
   on the same port (its peers' links redial it).
4. `stop()` SIGTERMs every live node, last added first (the router before
   the workers it dials), and SIGKILLs what has not exited after 10 s.

Nothing here kills by name: only the pids this object spawned.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


def rss_kb(pid: int) -> int | None:
    """VmRSS of a live process from /proc (kB), None when it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def healthy(port: int, timeout_s: float = 2.0) -> bool:
    """GET http://127.0.0.1:port/health answers 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass(slots=True)
class Node:
    """One node's process across its restarts."""

    name: str
    args: list[str]                   # after `command`
    port: int                         # where its /health answers
    cwd: Path | None = None
    command: tuple[str, ...] = ()     # () = this python -m pddgw
    env: dict[str, str] = field(default_factory=dict)     # over this process's environment
    proc: subprocess.Popen[bytes] | None = None
    kills: int = 0
    restarts: int = 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """None while running (or never started); -9 after a SIGKILL."""
        return None if self.proc is None else self.proc.poll()


class Processes:
    def __init__(self, directory: Path):
        self.dir = directory
        self.nodes: dict[str, Node] = {}

    def add(self, name: str, args: Sequence[str], port: int, cwd: Path | None = None,
            command: Sequence[str] = (), env: Mapping[str, str] | None = None) -> Node:
        if name in self.nodes:
            raise ValueError(f"node {name!r} is already declared")
        self.nodes[name] = node = Node(name, list(args), port, cwd, tuple(command), dict(env or {}))
        return node

    def spawn(self, name: str) -> Node:
        node = self.nodes[name]
        if node.alive:
            raise RuntimeError(f"{name} is still running (pid {node.proc.pid})")   # type: ignore[union-attr]
        # A node's first start begins its log afresh; a restart appends to what its death left.
        with open(self.dir / f"{name}.log", "ab" if node.proc is not None else "wb") as log:
            node.proc = subprocess.Popen([*(node.command or (sys.executable, "-m", "pddgw")), *node.args],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=node.cwd, env={**os.environ, "PYTHONUNBUFFERED": "1", **node.env})
        return node

    def start(self, timeout_s: float = 120.0) -> None:
        """Spawn every node in order and wait until each is ready; on failure stop what runs."""
        try:
            for name in self.nodes:
                self.spawn(name)
            self.wait_ready(timeout_s=timeout_s)
        except BaseException:
            self.stop()
            raise

    # ---- readiness ---------------------------------------------------------------------

    def _not_ready(self, pending: Iterable[str], deadline: float, timeout_s: float) -> list[str]:
        """The nodes of `pending` not answering /health yet; RuntimeError when one exited or time is up."""
        left = []
        for name in pending:
            node = self.nodes[name]
            if not node.alive:
                raise RuntimeError(f"{name} exited (rc {node.returncode}):\n{self.log(name)}")
            if not healthy(node.port):
                left.append(name)
        if left and time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(left)} did not come up within {timeout_s:.0f} s:\n"
                               + "\n".join(self.log(n) for n in left))
        return left

    def wait_ready(self, names: Iterable[str] | None = None, timeout_s: float = 120.0) -> None:
        pending = list(self.nodes if names is None else names)
        deadline = time.monotonic() + timeout_s
        while pending := self._not_ready(pending, deadline, timeout_s):
            time.sleep(0.2)

    async def wait_ready_async(self, names: Iterable[str] | None = None, timeout_s: float = 120.0) -> None:
        """`wait_ready` without blocking the event loop (the probes run on a worker thread)."""
        pending = list(self.nodes if names is None else names)
        deadline = time.monotonic() + timeout_s
        while pending := await asyncio.to_thread(self._not_ready, pending, deadline, timeout_s):
            await asyncio.sleep(0.2)

    # ---- faults and the end --------------------------------------------------------------

    def kill(self, name: str) -> int | None:
        """SIGKILL by pid and reap -> the pid, or None when it was not running."""
        node = self.nodes[name]
        if not node.alive:
            return None
        assert node.proc is not None
        node.proc.kill()
        node.proc.wait(10)
        node.kills += 1
        return node.proc.pid

    def restart(self, name: str) -> bool:
        """Spawn a dead node again (-> True; the caller waits for it), or nothing when it runs (-> False)."""
        if self.nodes[name].alive:
            return False
        self.spawn(name)
        self.nodes[name].restarts += 1
        return True

    def stop(self) -> None:
        """SIGTERM every live node (last added first), SIGKILL what has not exited after 10 s."""
        order = list(reversed(self.nodes.values()))
        for node in order:
            if node.alive:
                node.proc.terminate()      # type: ignore[union-attr]
        for node in order:
            if node.proc is None:
                continue
            try:
                node.proc.wait(10)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(5)

    def log(self, name: str, chars: int | None = 4000) -> str:
        """The last `chars` characters of a node's log (None: all of it; "" when it has none)."""
        try:
            text = (self.dir / f"{name}.log").read_text(errors="replace")
            return text if chars is None else text[-chars:]
        except OSError:
            return ""

    def rss_kb(self, name: str) -> int | None:
        node = self.nodes[name]
        return rss_kb(node.proc.pid) if node.alive else None      # type: ignore[union-attr]
