"""A benchmark's peer process on loopback, and the raw TCP ceiling it serves.

`running_peer(module, secret, **args)` runs `python -m module --peer` for
the length of a `with` and yields the addresses it prints first (one JSON
line).  In the peer, `run_peer(peer_main)` calls `peer_main(secret, **args)`
on uvloop, and `serve_peer` serves a `WsServer` and the raw TCP server until
the parent closes the peer's stdin.  Raw TCP: per connection the peer reads
one `RAW_REQ` (op S: it sends `total` bytes in `chunk`-byte sends; R: it
receives them and answers one byte); `raw_rate` times it from the parent,
`recv_into` preallocated memory.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import orjson

from pddgw.config import NetConfig
from pddgw import messages as m
from pddgw.net.ws import WsServer

RAW_REQ = struct.Struct("!cQQ")          # op (S: peer sends, R: peer receives), total, chunk
_SECRET, _ARGS = "PDDGW_BENCH_SECRET", "PDDGW_BENCH_PEER"


@contextmanager
def running_peer(module: str, secret: str, **args: Any) -> Iterator[dict]:
    """`python -m module --peer`, given `secret` and `args` (JSON) -> the addresses it printed; on exit its
    stdin is closed and it is waited for (killed after 30 s)."""
    proc = subprocess.Popen([sys.executable, "-m", module, "--peer"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, _SECRET: secret, _ARGS: orjson.dumps(args).decode()})
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{module} peer failed to start")
        yield orjson.loads(line)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_peer(peer_main: Callable[..., Awaitable[None]]) -> int:
    """In the peer (`--peer`): `peer_main(secret, **args)` as `running_peer` passed them, on uvloop."""
    import uvloop

    uvloop.run(peer_main(os.environ[_SECRET], **orjson.loads(os.environ[_ARGS])))
    return 0


async def serve_peer(server: WsServer, raw_src: memoryview, **addresses: str) -> None:
    """In the peer: `server` and the raw TCP server (sending from `raw_src`) on free loopback ports, their
    addresses ("ws", "raw", then `addresses`) printed for `running_peer`, served until our stdin closes."""
    url = await server.start("127.0.0.1", 0)
    raw = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_server, args=(raw, raw_src), daemon=True).start()
    print(orjson.dumps({"ws": url, "raw": raw.getsockname()[1], **addresses}).decode(), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    raw.close()                                  # ends the raw server's thread
    await server.close()


def bench_net(secret: str, kv_frame_bytes: int, timeout_s: float) -> NetConfig:
    return NetConfig(secret=secret, max_frame_bytes=max(16 << 20, 2 * kv_frame_bytes),
                     kv_frame_bytes=kv_frame_bytes, inbound_buffer_bytes=256 << 20, heartbeat_s=0,
                     request_timeout_s=timeout_s, send_timeout_s=timeout_s)


class Ring:
    """KV sink: hands out consecutive slices of one preallocated buffer."""

    def __init__(self, nbytes: int) -> None:
        self.buf = memoryview(bytearray(nbytes))
        self.off = 0

    def __call__(self, span: m.KVSpan) -> memoryview:
        n = span.nbytes
        if self.off + n > len(self.buf):
            self.off = 0
        view = self.buf[self.off:self.off + n]
        self.off += n
        return view


def _raw_server(sock: socket.socket, src: memoryview) -> None:
    dst = memoryview(bytearray(len(src)))
    while True:
        try:
            c, _ = sock.accept()
        except OSError:
            return
        with c:
            op, total, chunk = RAW_REQ.unpack(c.recv(RAW_REQ.size, socket.MSG_WAITALL))
            done = 0
            if op == b"S":
                while done < total:
                    c.sendall(src[:chunk])
                    done += chunk
            else:
                while done < total:
                    n = c.recv_into(dst)
                    if n == 0:
                        break
                    done += n
                c.sendall(b"k")


def raw_rate(port: int, op: bytes, total: int, chunk: int, buf: memoryview) -> float:
    """Raw TCP rate in bytes/s (op S: peer -> us, R: us -> peer)."""
    with socket.create_connection(("127.0.0.1", port)) as c:
        t0 = time.perf_counter()
        c.sendall(RAW_REQ.pack(op, total, chunk))
        done = 0
        if op == b"S":
            while done < total:
                n = c.recv_into(buf)    # reads as large as the kernel offers: the best case
                if n == 0:
                    raise ConnectionError("peer closed early")
                done += n
        else:
            while done < total:
                c.sendall(buf[:chunk])
                done += chunk
            c.recv(1)
        return total / (time.perf_counter() - t0)
