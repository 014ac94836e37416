"""A hostile peer on a real worker's node-link port, speaking raw RFC 6455 + pddgw frames.

One `pddgw serve --role md` process (started here, stopped here by its pid).
Frames are fuzzed before the Hello (aiohttp's reader), after it (the
connection's reader, not authenticated yet) and after a correct
authentication.  Where the header alone decides, `expected_code` says which
close code the worker must send; the worker must never die, must keep
answering /health, must not grow for huge claims, and must keep serving an
honest peer.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import socket
import struct
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pddgw.harness.launch import Processes
from pddgw.harness.ports import free_port
from pddgw.net import auth, frames
from pddgw import messages as m
from pddgw.net.errors import CloseCode
from pddgw.net.wsproto import HANDSHAKE_MAX

SECRET = "fuzz-test-secret-0123456789"
MAX_FRAME = 32 << 20           # large on purpose: before the fix a claim this size was allocated
MAX_CONTROL = 1 << 20
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _get(port: int, path: str, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@dataclasses.dataclass
class Worker:
    proc: subprocess.Popen
    port: int
    log: Path

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def assert_alive(self) -> None:
        assert self.proc.poll() is None, self.log.read_text(errors="replace")[-4000:]
        assert _get(self.port, "/health") == (200, {"status": "ok", "node": "md0", "role": "md"})


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    port = free_port()
    cfg = tmp / "config.toml"
    cfg.write_text(f'''
[engine]
num_blocks = 64
block_size = 16

[net]
secret = "{SECRET}"
max_frame_bytes = {MAX_FRAME}
kv_frame_bytes = {1 << 20}
max_control_bytes = {MAX_CONTROL}
inbound_buffer_bytes = {2 * MAX_FRAME}
auth_timeout_s = 30.0
heartbeat_s = 0

[[nodes]]
name = "router"
role = "router"
cluster = "A"

[[nodes]]
name = "p0"
role = "prefill"
cluster = "A"
port = {free_port()}

[[nodes]]
name = "md0"
role = "md"
cluster = "B"
port = {port}
''')
    procs = Processes(tmp)
    procs.add("md0", ["serve", "--role", "md", "--node", "md0", "--config", str(cfg), "--host", "127.0.0.1",
                      "--port", str(port)], port)
    procs.start()
    try:
        w = Worker(procs.nodes["md0"].proc, port, tmp / "md0.log")
        w.assert_alive()
        yield w
    finally:
        procs.stop()


# ---------------------------------------------------------------------------
# A raw peer


class Raw:
    """One TCP connection upgraded to a WebSocket at /pddgw/link; frames by hand."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=20)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(f"GET /pddgw/link HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                          f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                          f"Sec-WebSocket-Version: 13\r\n\r\n".encode())
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 101"), head

    def _more(self) -> bool:
        data = self.sock.recv(1 << 16)
        self.buf += data
        return bool(data)

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_frame(self, body: bytes, *, ws_len: int | None = None, masked: bool = True, opcode: int = 2) -> None:
        """One WebSocket frame carrying `body`, its header claiming `ws_len` bytes (default: the truth)."""
        n = len(body) if ws_len is None else ws_len
        b1 = 0x80 if masked else 0
        hdr = (bytes((0x80 | opcode, b1 | n)) if n < 126 else struct.pack("!BBH", 0x80 | opcode, b1 | 126, n)
               if n < 1 << 16 else struct.pack("!BBQ", 0x80 | opcode, b1 | 127, n))
        if masked:
            key = os.urandom(4)
            body = key + bytes(b ^ key[i % 4] for i, b in enumerate(body))
        self.send_raw(hdr + body)

    def send_msg(self, msg: m.Message, corr: int = 0, seq: int = 0) -> None:
        self.send_frame(frames.encode_bytes(msg, corr=corr, seq=seq))

    def recv_ws(self) -> tuple[int, bytes] | None:
        """The next server frame (opcode, payload); None at EOF."""
        while (frame := self._parse()) is None:
            if not self._more():
                return None
        return frame

    def _parse(self) -> tuple[int, bytes] | None:
        b = self.buf
        if len(b) < 2:
            return None
        n, pos = b[1] & 0x7F, 2
        if n >= 126:
            pos = 4 if n == 126 else 10
            if len(b) < pos:
                return None
            n = int.from_bytes(b[2:pos], "big")
        if len(b) < pos + n:
            return None
        self.buf = b[pos + n:]
        return b[0] & 0x0F, b[pos:pos + n]

    def recv_msg(self) -> frames.Frame:
        got = self.recv_ws()
        assert got is not None and got[0] == 2, got
        return frames.decode(got[1])

    def close_code(self) -> int | None:
        """Read until the server's close frame -> its code; None if the connection ends without one."""
        try:
            while (got := self.recv_ws()) is not None:
                if got[0] == 0x8:
                    return struct.unpack_from("!H", got[1])[0] if len(got[1]) >= 2 else CloseCode.NORMAL
        except ConnectionResetError:
            pass
        return None

    def end(self) -> int | None:
        """We stop sending (EOF); -> the close code the server sent, if any."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        code = self.close_code()
        self.close()
        return code

    def close(self) -> None:
        self.sock.close()


def hello() -> m.Hello:
    return m.Hello("fuzzer", auth.new_nonce()[:32], 0, 1, auth.new_nonce())


def greeted(port: int) -> Raw:
    """Past the Hello: the worker's connection reader has the connection, not authenticated."""
    r = Raw(port)
    r.send_msg(hello())
    assert isinstance(r.recv_msg().msg, m.Challenge)
    return r


def authenticated(port: int) -> Raw:
    r = Raw(port)
    h = hello()
    r.send_msg(h)
    ch = r.recv_msg().msg
    assert isinstance(ch, m.Challenge) and auth.verify(auth.server_proof(SECRET, h, ch.node, ch.nonce), ch.proof)
    r.send_msg(m.Auth(auth.client_proof(SECRET, h, ch.node, ch.nonce)))
    assert isinstance(r.recv_msg().msg, m.Welcome)
    return r


def ask_state(r: Raw, seq: int) -> m.NodeState:
    r.send_msg(m.StateQuery("md0"), corr=seq + 1, seq=seq)
    reply = r.recv_msg()
    assert reply.head.is_reply and reply.head.corr == seq + 1
    assert isinstance(reply.msg, m.NodeState)
    return reply.msg


def kv_claim(span: m.KVSpan, payload_len: int | None = None) -> bytes:
    """Header + metadata of a KVChunk over `span`, no payload."""
    meta = orjson.dumps({f.name: getattr(span, f.name) for f in dataclasses.fields(m.KVSpan)}
                        | {"seq": 0, "last": True})
    n = span.payload_nbytes if payload_len is None else payload_len
    return frames.HEADER.pack(frames.MAGIC, frames.VERSION, m.KV_KIND, 0, 0, len(meta), 0, 0, n) + meta


BIG = m.KVSpan("big", 0, 1, 0, 1000, "float16", (1, 2, 1000, 8, 1024))      # 31.25 MiB, a frame under MAX_FRAME
HUGE = m.KVSpan("huge", 0, 1, 0, 1024, "float16", (1, 2, 1024, 100, 512))   # 200 MiB


# ---------------------------------------------------------------------------
# The oracle: the close code a frame's first bytes decide


# Item sizes of the kinds whose payload is an int array (the pipeline's registered kinds included).
_PACKED = {k: frames._ITEM_SIZE[s.packed] for k, s in frames._SCHEMAS.items() if s.packed in frames._ITEM_SIZE}
_PAYLOAD_KINDS = {m.KV_KIND} | set(_PACKED)


def expected_code(authed: bool, masked: bool, ws_len: int, kind: int, meta_len: int, payload_len: int) -> int:
    """What the worker must answer to a frame whose WebSocket header and pddgw header are these
    (and whose metadata is not JSON)."""
    if not masked:
        return CloseCode.PROTOCOL_ERROR
    if not authed and ws_len > HANDSHAKE_MAX:
        return CloseCode.TOO_BIG
    if ws_len > MAX_FRAME:
        return CloseCode.TOO_BIG
    if ws_len < frames.HEADER_SIZE:
        return CloseCode.BAD_FRAME
    if authed and frames.HEADER_SIZE + meta_len + payload_len > (MAX_FRAME if kind == m.KV_KIND else MAX_CONTROL):
        return CloseCode.TOO_BIG
    if payload_len and (kind not in _PAYLOAD_KINDS or payload_len % _PACKED.get(kind, 1)):
        return CloseCode.BAD_FRAME
    if not authed and kind not in m.HANDSHAKE_KINDS:
        return CloseCode.PROTOCOL_ERROR
    return CloseCode.BAD_FRAME     # sizes disagree with the WebSocket length, or the metadata is not JSON


frame_heads = st.fixed_dictionaries({
    "masked": st.sampled_from([True, True, True, False]),        # mostly masked, as clients must
    "kind": st.sampled_from(sorted(frames._SCHEMAS)),
    "meta_len": st.integers(0, 300) | st.integers(0, 0xFFFF),
    "payload_len": st.just(0) | st.integers(1, 64) | st.integers(0, 0xFFFF_FFFF),
    "ws_len": st.none() | st.integers(0, 5000) | st.integers(0, 1 << 40),    # None: the header's size
})


def send_head(r: Raw, masked: bool, kind: int, meta_len: int, payload_len: int, ws_len: int | None) -> int:
    size = frames.HEADER_SIZE + meta_len + payload_len
    ws_len = size if ws_len is None else ws_len
    head = frames.HEADER.pack(frames.MAGIC, frames.VERSION, kind, 0, 0, meta_len, 0, 0, payload_len)
    # Metadata that is not JSON, as much as the WebSocket message has room for (nothing is awaited past it).
    body = (head + b"\x00" * meta_len)[:max(0, min(ws_len, frames.HEADER_SIZE + meta_len))]
    r.send_frame(body, ws_len=ws_len, masked=masked)
    return ws_len


# ---------------------------------------------------------------------------
# Tests


def test_debug_state_needs_the_net_secret(worker):
    assert _get(worker.port, "/debug/state")[0] == 401
    code, body = _get(worker.port, "/debug/state", {"Authorization": "Bearer not-the-secret-at-all"})
    assert code == 401 and "Authorization" in body["error"]
    code, body = _get(worker.port, "/debug/state", {"Authorization": f"Bearer {SECRET}"})
    assert code == 200 and body["node"] == "md0" and body["kv_blocks_in_use"] == 0


def test_huge_claims_before_authentication_are_closed_at_once_and_allocate_nothing(worker):
    for _ in range(3):        # the worker's allocator and aiohttp's per-connection state settle first
        r = greeted(worker.port)
        r.send_frame(kv_claim(BIG), ws_len=len(kv_claim(BIG)) + BIG.nbytes)
        assert r.close_code() == CloseCode.TOO_BIG
        r.close()
    before = worker.rss_kib()
    peers = [greeted(worker.port) for _ in range(16)]
    for r in peers:           # consistent claims a worker would have allocated 31 MiB each for
        r.send_frame(kv_claim(BIG), ws_len=len(kv_claim(BIG)) + BIG.nbytes)
    codes = [r.close_code() for r in peers]
    grown = worker.rss_kib() - before
    for r in peers:
        r.close()
    assert codes == [CloseCode.TOO_BIG] * 16
    assert grown < 8 << 10, f"worker RSS grew by {grown} KiB for 16 refused claims"
    r = greeted(worker.port)  # the WebSocket length is honest, the frame claims 200 MiB of KV
    r.send_frame(kv_claim(HUGE))
    assert r.close_code() == CloseCode.PROTOCOL_ERROR
    r.close()
    worker.assert_alive()


@pytest.mark.parametrize("send, code", [
    (lambda r: r.send_frame(kv_claim(HUGE), ws_len=len(kv_claim(HUGE)) + HUGE.nbytes), CloseCode.TOO_BIG),
    (lambda r: r.send_frame(frames.encode_bytes(m.Ready("r"))), CloseCode.PROTOCOL_ERROR),
    (lambda r: r.send_frame(frames.encode_bytes(m.Auth("0" * 64)), masked=False), CloseCode.PROTOCOL_ERROR),
    (lambda r: r.send_frame(b"hello?", opcode=1), CloseCode.UNSUPPORTED_DATA),
    (lambda r: r.send_frame(frames.encode_bytes(m.Auth("0" * 64)) + b"x"), CloseCode.BAD_FRAME),
    (lambda r: r.send_msg(m.Auth("0" * 64)), CloseCode.AUTH_FAILED),
], ids=["ws-200MiB-kv", "ready", "unmasked", "text", "ws-longer", "wrong-proof"])
def test_each_violation_before_authentication_has_its_close_code(worker, send, code):
    r = greeted(worker.port)
    send(r)
    assert r.close_code() == code
    r.close()


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_random_bytes_before_the_hello(worker, data):
    r = Raw(worker.port)
    r.send_raw(data)
    code = r.end()
    assert code is None or 1000 <= code < 5000
    worker.assert_alive()


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_random_bytes_after_the_hello(worker, data):
    r = greeted(worker.port)
    r.send_raw(data)
    code = r.end()
    assert code is None or 1000 <= code < 5000         # random bytes may be a close frame with any code
    worker.assert_alive()


@FUZZ
@given(frame_heads)
def test_fuzz_frame_headers_before_authentication(worker, head):
    r = greeted(worker.port)
    ws_len = send_head(r, **head)
    expected = expected_code(False, head["masked"], ws_len, head["kind"], head["meta_len"], head["payload_len"])
    assert r.close_code() == expected
    r.close()


@FUZZ
@given(frame_heads)
def test_fuzz_frame_headers_after_authentication(worker, head):
    r = authenticated(worker.port)
    ws_len = send_head(r, **head)
    expected = expected_code(True, head["masked"], ws_len, head["kind"], head["meta_len"], head["payload_len"])
    assert r.close_code() == expected
    r.close()


def test_after_the_fuzzing_the_worker_serves_an_honest_peer(worker):
    worker.assert_alive()
    r = authenticated(worker.port)
    st1 = ask_state(r, 0)
    assert (st1.node, st1.role, st1.kv_blocks_in_use, st1.kv_blocks_total) == ("md0", "md", 0, 64)
    assert ask_state(r, 1) == st1           # the connection stays usable: nothing swallowed or left over
    r.close()
    worker.assert_alive()
