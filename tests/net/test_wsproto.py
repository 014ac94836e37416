"""The WebSocket frame reader without sockets: chunking, control frames, violations, fuzzing."""

from __future__ import annotations

import asyncio
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from net_samples import SPAN, every_message, kv_payload, same

from pddgw.net import frames
from pddgw.net import messages as m
from pddgw.net.errors import CloseCode
from pddgw.net.wsproto import OP_PING, ConnState, WsConnection, ws_header


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
    wire = run(_client_wire([m.KvChunk(SPAN, kv_payload(), 0, True)]))
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
