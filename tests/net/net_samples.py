"""One valid instance of every message kind, shared by the codec and link tests."""

from __future__ import annotations

from pddgw import messages as m

SPAN = m.KVSpan("req-1", 2, 4, 16, 24, "float16", (2, 2, 8, 2, 4))


def kv_payload(span: m.KVSpan = SPAN, salt: int = 0) -> bytearray:
    return bytearray((i * 7 + salt) % 251 for i in range(span.nbytes))


def every_message() -> list[m.Message]:
    """One of each kind (the handshake kinds included: they are ordinary frames to the codec)."""
    return [
        m.Hello("p-0", "a" * 32, 1, 3, "0" * 64, "wan"),
        m.Challenge("md-0", "1" * 64, "f" * 64),
        m.Auth("e" * 64),
        m.Welcome(),
        m.KVChunk(SPAN, kv_payload(), 3, True),
        m.TokenIds("req-1", 37, tuple(range(100, 200))),
        m.TokenItem("req-1", 40, (5, 6, 7), True, "stop"),
        m.TokenBatch((m.TokenItem("req-2", 0, (1, 2)), m.TokenItem("req-3", 9, (), True, "length"))),
        m.Ready("req-1", "kv"),
        m.Ack("req-1", 9, "placed"),
        m.Cancel("req-1", "user went away"),
        m.Error("req-1", "oom", "no free KV blocks"),
        m.LoadReport("md-0", 3, 1, 100, 512, 1 << 20, 1234.5),
        m.PrefixQuery("req-1", (0, 1, (1 << 64) - 1, 12345678901234567890)),
        m.PrefixAnswer("req-1", 3),
        m.Ping(123456789),
        m.Pong(987654321),
    ]


def same(a: m.Message, b: m.Message) -> bool:
    """Equality that compares KV payloads by content (buffers do not compare by value)."""
    if isinstance(a, m.KVChunk) and isinstance(b, m.KVChunk):
        return (a.span, a.seq, a.last) == (b.span, b.seq, b.last) and bytes(a.payload) == bytes(b.payload)
    return a == b
