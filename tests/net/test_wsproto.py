"""The WebSocket frame reader without sockets: chunking, control frames, violations, fuzzing,
bounds before authentication, frame boundaries, and a striped link's reordering."""

from __future__ import annotations

import asyncio
import dataclasses
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from net_samples import SPAN, every_message, kv_payload, same

import orjson

from pddgw.config import NetConfig
from pddgw.net import frames, wsproto
from pddgw import messages as m
from pddgw.net.errors import CloseCode
from pddgw.net.ws import WsLink
from pddgw.net.wsproto import HANDSHAKE_MAX, OP_PING, ConnState, WsConnection, ws_header


class FakeTransport:
    def __init__(self) -> None:
        self.out = bytearray()
        self.closing = False

    def get_extra_info(self, name, default=None):
        return default

    def set_protocol(self, p): ...
    def set_write_buffer_limits(self, high=None, low=None): ...
    def pause_reading(self): ...
    def resume_reading(self): ...
    def get_write_buffer_size(self): return 0

    def write(self, data):
        self.out += data

    def writelines(self, bufs):
        for b in bufs:
            self.out += b

    def is_closing(self):
        return self.closing

    def close(self):
        self.closing = True

    abort = close


class Prev:
    def connection_lost(self, exc): ...


_LOOP = asyncio.new_event_loop()


def run(coro):
    return _LOOP.run_until_complete(coro)


async def _conn(client: bool, max_frame: int = 1 << 20, sink=None) -> tuple[WsConnection, FakeTransport, list]:
    t = FakeTransport()
    c = WsConnection(t, Prev(), client=client, max_frame=max_frame, max_control=1 << 16, peer="fuzz")
    c.attach()
    c.kv_sink = sink
    got: list = []
    c.state = ConnState.READY
    c.open(lambda conn, head, msg, wire, owned: got.append((head, msg, wire)))
    return c, t, got


def feed(conn: WsConnection, data: bytes, chunk: int) -> None:
    pos = 0
    while pos < len(data):
        buf = conn.get_buffer(-1)
        n = min(len(buf), chunk, len(data) - pos)
        buf[:n] = data[pos:pos + n]
        conn.buffer_updated(n)
        pos += n


async def _client_wire(msgs: list[m.Message]) -> bytes:
    """What a client connection writes for `msgs` (masked)."""
    c, t, _ = await _conn(client=True)
    for i, msg in enumerate(msgs):
        head, payload = frames.encode(msg, seq=i)
        c.write(c.frame_buffers(head, payload, copy=False)[0])
    return bytes(t.out)


def close_code(out: bytes) -> int:
    """Close code of the (unmasked, server-side) close frame at the end of `out`."""
    i = out.rfind(b"\x88")
    assert i >= 0, out
    return struct.unpack_from("!H", out, i + 2)[0]


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20])
def test_any_chunking_gives_the_same_messages(chunk):
    msgs = every_message()
    wire = run(_client_wire(msgs))
    conn, t, got = run(_conn(client=False))
    feed(conn, wire, chunk)
    assert [h.seq for h, _, _ in got] == list(range(len(msgs)))
    assert all(same(x, y) for (_, x, _), y in zip(got, msgs))
    assert sum(w for _, _, w in got) == len(wire) and not t.closing


def test_payload_lands_unmasked_in_the_sink_memory():
    memory = bytearray(SPAN.nbytes)
    wire = run(_client_wire([m.KVChunk(SPAN, kv_payload(), 0, True)]))
    conn, t, got = run(_conn(client=False, sink=lambda span: memoryview(memory)))
    feed(conn, wire, 1 << 20)
    assert got[0][1].payload.obj is memory and memory == kv_payload()


def test_ping_is_answered_and_close_is_echoed():
    conn, t, _ = run(_conn(client=False))
    key = b"\x01\x02\x03\x04"
    masked = bytes(b ^ key[i % 4] for i, b in enumerate(b"hi"))
    feed(conn, ws_header(2, True, OP_PING) + key + masked, 100)
    assert bytes(t.out) == b"\x8a\x02hi"                      # pong, same payload
    close = struct.pack("!H", 4001) + b"bye"
    feed(conn, ws_header(len(close), True, 0x8) + key + bytes(b ^ key[i % 4] for i, b in enumerate(close)), 100)
    assert close_code(bytes(t.out)) == 4001 and t.closing


@pytest.mark.parametrize("frame, code", [
    (b"\x81\x82abcd" + b"xx", CloseCode.UNSUPPORTED_DATA),        # text
    (b"\x02\x82abcd" + b"xx", CloseCode.PROTOCOL_ERROR),          # not FIN (fragmented)
    (b"\xc2\x82abcd" + b"xx", CloseCode.PROTOCOL_ERROR),          # RSV1 (compressed)
    (b"\x82\x02xx", CloseCode.PROTOCOL_ERROR),                    # unmasked from a client
    (b"\x83\x82abcdxx", CloseCode.PROTOCOL_ERROR),                # reserved opcode
    (b"\x89\xfe\x00\x80abcd", CloseCode.PROTOCOL_ERROR),          # control frame > 125 bytes
    (b"\x82\xff" + struct.pack("!Q", 1 << 40) + b"abcd", CloseCode.TOO_BIG),
    (b"\x82\x85abcd12345", CloseCode.BAD_FRAME),                  # shorter than a frame header
])
def test_violations_close_with_their_code(frame, code):
    conn, t, got = run(_conn(client=False))
    feed(conn, frame, 100)
    assert conn.state == ConnState.CLOSING and close_code(bytes(t.out)) == code and got == []


def test_server_frames_must_not_be_masked():
    conn, t, _ = run(_conn(client=True))
    feed(conn, b"\x82\x82abcdxx", 100)
    assert conn.state == ConnState.CLOSING


def test_control_kind_over_its_limit_is_too_big():
    conn, t, _ = run(_conn(client=False))
    wire = run(_client_wire([m.Ready("r", "x" * 4000)] * 1))
    conn._max_control = 1000
    feed(conn, wire, 64)
    assert close_code(bytes(t.out)) == CloseCode.TOO_BIG


VALID_WIRE = run(_client_wire(every_message()))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400), st.integers(1, 64))
def test_fuzz_reader_arbitrary_bytes(data, chunk):
    conn, t, got = run(_conn(client=False, max_frame=4096))
    feed(conn, data, chunk)      # must not raise
    if conn.state == ConnState.CLOSING:
        assert close_code(bytes(t.out)) in set(CloseCode)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(1, 300))
def test_fuzz_reader_mutated_frames(flips, chunk):
    data = bytearray(VALID_WIRE)
    for pos, val in flips:
        data[pos % len(data)] = val
    conn, t, got = run(_conn(client=False))
    feed(conn, bytes(data), chunk)
    if conn.state == ConnState.CLOSING:
        assert close_code(bytes(t.out)) in set(CloseCode)
    assert all(isinstance(msg, tuple(m.KINDS.values())) for _, msg, _ in got)


@pytest.fixture(scope="module", autouse=True)
def _close_loop():
    yield
    _LOOP.close()


# ---------------------------------------------------------------------------
# Before authentication: nothing allocated beyond the frame itself

KEY = b"\x1f\x2e\x3d\x4c"
HUGE = m.KVSpan("huge", 0, 1, 0, 1024, "float16", (1, 2, 1024, 100, 512))     # 200 MiB
MID = m.KVSpan("mid", 0, 1, 0, 4, "float16", (1, 2, 4, 8, 128))                # 16 KiB


def masked_msg(body: bytes, ws_len: int | None = None) -> bytes:
    """A client message carrying `body` whose WebSocket header claims `ws_len` bytes (default: the truth)."""
    n = len(body) if ws_len is None else ws_len
    return ws_header(n, True) + KEY + bytes(b ^ KEY[i % 4] for i, b in enumerate(body))


def kv_head(span: m.KVSpan, payload_len: int | None = None, seq: int = 0) -> bytes:
    """Header + metadata of a KVChunk over `span`, claiming `payload_len` payload bytes (default: the span's)."""
    meta = orjson.dumps({f.name: getattr(span, f.name) for f in dataclasses.fields(m.KVSpan)}
                        | {"seq": 0, "last": True})
    n = span.payload_nbytes if payload_len is None else payload_len
    return frames.HEADER.pack(frames.MAGIC, frames.VERSION, m.KV_KIND, 0, 0, len(meta), 0, seq, n) + meta


def with_payload_len(frame: bytes, n: int) -> bytes:
    return frame[:16] + struct.pack("<I", n) + frame[20:]


async def _hs_conn(client: bool = False) -> tuple[WsConnection, FakeTransport]:
    t = FakeTransport()
    c = WsConnection(t, Prev(), client=client, max_frame=1 << 20, max_control=1 << 16, peer="stranger")
    c.attach()
    return c, t


AUTH = frames.encode_bytes(m.Auth("e" * 64))


@pytest.mark.parametrize("wire, code", [
    # 200 MiB KVChunk claimed by the WebSocket length: over the handshake bound
    (masked_msg(kv_head(HUGE), ws_len=len(kv_head(HUGE)) + HUGE.nbytes), CloseCode.TOO_BIG),
    # a 16 KiB KVChunk: within max_frame_bytes, over the handshake bound
    (masked_msg(kv_head(MID), ws_len=len(kv_head(MID)) + MID.nbytes), CloseCode.TOO_BIG),
    # an honest WebSocket length, a frame header and metadata claiming 200 MiB: KV before auth
    (masked_msg(kv_head(HUGE)), CloseCode.PROTOCOL_ERROR),
    # a whole, valid, tiny KVChunk: still KV before auth
    (masked_msg(frames.encode_bytes(m.KVChunk(SPAN, kv_payload()))), CloseCode.PROTOCOL_ERROR),
    (masked_msg(frames.encode_bytes(m.Ready("r"))), CloseCode.PROTOCOL_ERROR),
    # a handshake kind whose header claims 200 MiB of payload it cannot carry
    (masked_msg(with_payload_len(AUTH, HUGE.nbytes)), CloseCode.BAD_FRAME),
    (masked_msg(AUTH + b"x", ws_len=len(AUTH) + 1), CloseCode.BAD_FRAME),
    (masked_msg(AUTH[:-1], ws_len=len(AUTH) - 1), CloseCode.BAD_FRAME),
], ids=["ws-200MiB-kv", "ws-16KiB-kv", "head-200MiB-kv", "tiny-kv", "ready", "auth-claims-payload",
        "ws-longer", "ws-shorter"])
@pytest.mark.parametrize("chunk", [1, 1 << 20])
def test_before_authentication_claims_close_before_any_allocation(wire, code, chunk, monkeypatch):
    sinks = []
    monkeypatch.setattr(wsproto, "sink_buffer", lambda *a: sinks.append(a))
    conn, t = run(_hs_conn())
    feed(conn, wire, chunk)
    assert conn.state == ConnState.CLOSING and close_code(bytes(t.out)) == code
    assert sinks == [] and conn._dest.nbytes == 0 and not conn._hs_frames
    assert len(conn._scratch) == HANDSHAKE_MAX and len(conn.get_buffer(-1)) == HANDSHAKE_MAX


def test_handshake_frames_pass_and_the_full_read_buffer_comes_with_authentication():
    conn, t = run(_hs_conn())
    feed(conn, masked_msg(AUTH), 7)
    assert list(conn._hs_frames) == [m.Auth("e" * 64)] and conn.state == ConnState.HANDSHAKE and not t.out
    assert len(conn.get_buffer(-1)) == HANDSHAKE_MAX
    conn.state = ConnState.READY
    assert len(conn.get_buffer(-1)) == 256 << 10


def test_frames_right_behind_the_welcome_are_link_frames_not_handshake_frames():
    conn, t = run(_hs_conn(client=True))
    hs = [m.Challenge("srv", "1" * 64, "f" * 64), m.Welcome()]
    link = [m.Ready("r", "kv"), m.KVChunk(SPAN, kv_payload(), 0, True)]
    wire = b"".join(ws_header(len(f), False) + f
                    for f in (frames.encode_bytes(x, seq=i) for i, x in enumerate(hs + link)))
    feed(conn, wire, 1 << 20)                       # one read: nothing in between
    assert list(conn._hs_frames) == hs and conn.state == ConnState.READY and not t.out
    got: list = []
    conn.open(lambda c, head, msg, w, owned: got.append(msg))
    assert len(got) == 2 and all(same(x, y) for x, y in zip(got, link))


# ---------------------------------------------------------------------------
# Frame boundaries: the header's sizes, the metadata and the WebSocket length agree


READY = frames.encode_bytes(m.Ready("r", "x"))
TOKENS = frames.encode_bytes(m.TokenIds("r", 0, (1, 2, 3)))


@pytest.mark.parametrize("wire", [
    masked_msg(READY + b"\0", ws_len=len(READY) + 1),          # WebSocket message longer than the frame
    masked_msg(READY[:-1], ws_len=len(READY) - 1),             # shorter
    masked_msg(TOKENS + bytes(4), ws_len=len(TOKENS) + 4),     # one more int32 than the header says
    masked_msg(with_payload_len(TOKENS, 16)),                  # header says 4 ids, the message carries 3
    # KV: header payload_len and WebSocket length agree, the span's payload size does not
    masked_msg(kv_head(SPAN, SPAN.nbytes + 4) + bytes(SPAN.nbytes + 4)),
    masked_msg(kv_head(SPAN, SPAN.nbytes - 4) + bytes(SPAN.nbytes - 4)),
], ids=["ws-longer", "ws-shorter", "ws-extra-item", "head-extra-item", "kv-over-span", "kv-under-span"])
def test_a_size_mismatch_closes_bad_frame_and_delivers_nothing(wire, monkeypatch):
    sinks = []
    monkeypatch.setattr(wsproto, "sink_buffer", lambda *a: sinks.append(a))
    conn, t, got = run(_conn(client=False))
    follow = masked_msg(frames.encode_bytes(m.Ready("next")))     # would be swallowed by a wrong boundary
    feed(conn, wire + follow, 1 << 20)
    assert close_code(bytes(t.out)) == CloseCode.BAD_FRAME and conn.state == ConnState.CLOSING
    assert got == [] and sinks == []


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_back_to_back_frames_split_at_their_boundary_are_both_delivered_whole(delta):
    msgs = [m.KVChunk(SPAN, kv_payload(), 0, True), m.Ready("next", "kv")]
    wire = run(_client_wire(msgs))
    n1 = len(frames.encode_bytes(msgs[0]))
    first = wsproto.ws_header_size(n1, masked=True) + n1
    conn, t, got = run(_conn(client=False))
    cut = first + delta
    feed(conn, wire[:cut], 1 << 20)
    assert len(got) == (0 if delta < 0 else 1)
    feed(conn, wire[cut:], 1 << 20)
    assert [w for _, _, w in got] == [first, len(wire) - first]
    assert all(same(x, y) for (_, x, _), y in zip(got, msgs)) and len(got) == 2 and not t.out


# ---------------------------------------------------------------------------
# A striped link's reordering: held frames count, only connections ahead pause


class LinkTransport(FakeTransport):
    """Tracks reading and, once closed, tells the protocol (as a real transport does)."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = True

    def set_protocol(self, p):
        self.proto = p

    def pause_reading(self):
        self.reading = False

    def resume_reading(self):
        self.reading = True

    def close(self):
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self.proto.connection_lost, None)

    abort = close


KV64 = lambda i: m.KVSpan("bulk", 0, 1, i * 16, (i + 1) * 16, "float16", (1, 2, 16, 8, 128))  # 64 KiB


def test_reordered_frames_count_and_pause_only_the_connection_ahead():
    async def scenario() -> None:
        bound = 256 << 10
        cfg = NetConfig(secret="test-secret-0123456789", heartbeat_s=0, max_frame_bytes=128 << 10,
                        kv_frame_bytes=64 << 10, max_control_bytes=64 << 10, inbound_buffer_bytes=bound)
        link = WsLink("srv", "cli", cfg, None)
        a, b = (WsConnection(LinkTransport(), Prev(), client=False, max_frame=cfg.max_frame_bytes,
                             max_control=cfg.max_control_bytes, peer=f"cli/{i}") for i in range(2))
        for c in (a, b):
            c.attach()
            c.state = ConnState.READY
        link._attach([a, b])
        got: list[int] = []

        async def handler(lk, msg):
            got.append(msg.seq)

        link.set_handler(handler)
        wires = {}
        for i in range(6):
            head, payload = frames.encode(m.KVChunk(KV64(i), kv_payload(KV64(i), salt=i), i), seq=i)
            wires[i] = masked_msg(head + payload.tobytes())
        w = len(wires[2])
        # seq 0 and 1 travel on a, which is slow; b delivers 2..5 ahead of them
        for i, held in ((2, 1), (3, 2), (4, 3)):
            feed(b, wires[i], 1 << 20)
            assert (len(link._reorder), link._held_bytes, b.transport.reading) == (held, held * w, True)
        feed(b, wires[5], 1 << 20)                       # 4 frames > 256 KiB: b stops, a reads on
        assert link._held_bytes == 4 * w > bound and not b.transport.reading and a.transport.reading
        link._set_reading(False)
        link._set_reading(True)                          # the inbox's resume leaves b paused
        assert not b.transport.reading and a.transport.reading
        feed(a, wires[0], 1 << 20)                       # seq 1 still missing: b still has frames ahead
        assert link._held_bytes == 4 * w and not b.transport.reading
        feed(a, wires[1], 1 << 20)
        assert link._held_bytes == 0 and link._reorder == {} and link._ahead_paused == set()
        # All six now wait in the inbox (6 x 64 KiB > 256 KiB): the link pauses both until it drains.
        assert not link._reading and not a.transport.reading and not b.transport.reading
        async with asyncio.timeout(30):
            while len(got) < 6 or link._inbound_bytes:
                await asyncio.sleep(0)
        assert got == list(range(6)) and link._inbound_bytes == 0
        assert link._reading and a.transport.reading and b.transport.reading
        await link.close()

    run(scenario())
