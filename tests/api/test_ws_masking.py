"""The front door's mask check: frames followed byte-exactly whatever the reads, stopped at an unmasked head."""

from __future__ import annotations

import pytest

from pddgw.api.ws_masking import MaskCheck

from .ws_raw import BINARY, CLOSE, PING, TEXT, frame


class Inner:
    """aiohttp's protocol, as the check sees it: what reached it."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.lost: list[Exception | None] = []

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.append(exc)


def check() -> tuple[MaskCheck, Inner]:
    inner = Inner()
    return MaskCheck(None, inner), inner      # type: ignore[arg-type]  (no transport: nothing to wake)


GOOD = [frame(TEXT, b"{}"), frame(PING, b"p"), frame(TEXT, b"[", fin=False), frame(0x0, b"]"),
        frame(BINARY, b"x" * 300), frame(TEXT, b"y" * 70_000), frame(TEXT), frame(CLOSE, b"\x03\xe8")]


@pytest.mark.parametrize("read", [1, 2, 3, 7, 13, 64, 1 << 20])
def test_masked_frames_pass_unchanged_and_whole_messages_are_counted(read):
    c, inner = check()
    wire = b"".join(GOOD)
    for i in range(0, len(wire), read):
        c.data_received(wire[i:i + read])
    assert bytes(inner.data) == wire
    assert c.reason is None
    assert c.complete == 5      # {}, the fragmented [ ], 300 x, 70 000 y, the empty text; not ping or close


@pytest.mark.parametrize("read", [1, 2, 5, 1 << 20])
@pytest.mark.parametrize("bad", [frame(TEXT, b"{}", mask=False), frame(PING, b"p", mask=False),
                                 frame(TEXT, b"z" * 70_000, mask=False),
                                 frame(TEXT, length=1 << 62, mask=False)],
                         ids=["text", "ping", "long", "huge"])
def test_an_unmasked_frame_and_all_after_it_never_reach_aiohttp(read, bad):
    c, inner = check()
    before = b"".join(GOOD[:5])
    wire = before + bad + frame(TEXT, b"{}")
    for i in range(0, len(wire), read):
        c.data_received(wire[i:i + read])
    # Whatever the reads, aiohttp got the frames before it (and at most the first byte of its head).
    assert bytes(inner.data) in (before, before + bad[:1])
    assert c.reason is not None and "5.1" in c.reason
    assert c.complete == 3      # {}, the fragmented [ ], 300 x


def test_a_huge_declared_length_is_counted_past_not_allocated():
    c, inner = check()
    head = frame(BINARY, length=1 << 40)           # the header alone; its payload never comes
    c.data_received(head + b"\0" * 1000)
    assert len(inner.data) == len(head) + 1000 and c.reason is None and c.complete == 0


def test_connection_lost_reaches_aiohttp():
    c, inner = check()
    c.connection_lost(None)
    assert inner.lost == [None]
