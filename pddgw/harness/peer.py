"""A benchmark's peer process on loopback, and the raw TCP ceiling it serves.

`spawn_peer(module, env)` runs `python -m module --peer` and reads the one
JSON line it prints first (its addresses); the peer serves until its stdin
closes (`until_stdin_closes`); `stop_peer` closes it and waits, then kills
by pid.  Raw TCP: per connection `serve_raw` reads one `RAW_REQ` (op S: it
sends `total` bytes in `chunk`-byte sends; R: it receives them and answers
one byte); `raw_rate` times it from the parent, `recv_into` preallocated
memory.
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
from collections.abc import Mapping

import orjson

from pddgw.config import NetConfig
from pddgw.net import messages as m

RAW_REQ = struct.Struct("!cQQ")          # op (S: peer sends, R: peer receives), total, chunk


def spawn_peer(module: str, env: Mapping[str, str]) -> tuple[subprocess.Popen, dict]:
    """`python -m module --peer` with `env` added to ours -> (the process, its first JSON line)."""
    proc = subprocess.Popen([sys.executable, "-m", module, "--peer"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env={**os.environ, **env})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{module} peer failed to start")
    return proc, orjson.loads(line)


def stop_peer(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def until_stdin_closes() -> None:
    """In the peer: until the parent closes our stdin (or kills us)."""
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


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


def serve_raw(src: memoryview) -> socket.socket:
    """In the peer: the raw TCP server on a free loopback port, on a thread (close the socket to end it)."""
    sock = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_server, args=(sock, src), daemon=True).start()
    return sock


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
