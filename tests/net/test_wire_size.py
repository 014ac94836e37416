"""`frames.frame_size` / `inproc.wire_size`: the bytes a frame takes, counted without encoding it.

In-process links charge the emulated wire by this count for every frame, so it
must equal what `frames.encode` produces for every message kind, the
pipeline's included, byte for byte.
"""

from __future__ import annotations

import pytest
from net_samples import SPAN, every_message, kv_payload

from pddgw.net import frames
from pddgw import messages as m
from pddgw.core.sampling import SamplingParams
from pddgw.net.errors import FrameTooLarge
from pddgw.net.inproc import wire_size
from pddgw.net.wsproto import ws_header_size

_SAMPLING = {"sampling": SamplingParams(max_tokens=64, temperature=0.7, top_k=20, top_p=0.95, seed=7,
                                        stop_token_ids=(2, 32000), logprobs=3, min_p=0.05,
                                        repetition_penalty=1.1, logit_bias={5: -2.5})}


def pipeline_messages() -> list[m.Message]:
    """One of each pipeline kind (100+), with non-trivial values (unicode, packed fields, tuples)."""
    return [
        m.Submit(**_SAMPLING, request_id="r-é", kv="import", hold=True, prompt=tuple(range(300)),
                  supersedes=("old-1",)),
        m.Opened("r1", 4096),
        m.Prefill(**_SAMPLING, request_id="r1", targets=("rld-0", "md-1"), starts=(0, 32),
                   prompt=tuple(range(10, 75)), holds=(False, True), blocks=(16, 32)),
        m.PrefillDone("r1", 17, 1024, (1 << 33, 5), ("", "boom"), (1.5, 0.25)),
        m.HandOff("r1", "md-0", "catch-up", 8, 256, 4, 31.25, True),
        m.HandedOff("r1", 900),
        m.HandoffRound("r1", 10, 20, False),
        m.Extend("r1", 5, True, (7, 8, 9, 1 << 30)),
        m.StateQuery("md-0"),
        m.NodeState("md-0", "md", 1, 2, 3, 4, 5, 6, 7, 8, 9, 10),
        m.KvDone("r1", 42, False),
        m.Demote("r1"),
        m.Logprobs("r1", 3, 2, (-0.5, -1.25), (-0.1, -0.2, -0.3, -0.4), (11, 12, 13, 14)),
        m.PromptLogprobsQuery("r1", 1),
        m.Draining("md-0", 22.5),
    ]


def _encoded(msg: m.Message) -> int:
    head, payload = frames.encode(msg)
    return len(head) + payload.nbytes


def test_samples_cover_every_kind():
    assert {type(x) for x in every_message() + pipeline_messages()} == set(m.KINDS.values()) - {
        cls for cls in m.KINDS.values() if cls.__module__.startswith("tests") or cls.__module__ == "test_frames"}


@pytest.mark.parametrize("msg", every_message() + pipeline_messages(), ids=lambda x: x.tag)
def test_frame_size_is_the_encoded_length(msg):
    assert frames.frame_size(msg) == _encoded(msg)


def test_pinned_sizes():
    # Ack: 20-byte header + b'{"request_id":"r","seq":3,"detail":""}' (38 bytes).
    assert frames.frame_size(m.Ack("r", 3)) == 20 + 38
    # Extend: header + b'{"request_id":"r1","start":5,"final":true}' (42) + 4 int32 ids (16).
    assert frames.frame_size(m.Extend("r1", 5, True, (7, 8, 9, 1 << 30))) == 20 + 42 + 16
    # A 126..65535-byte frame takes a 4-byte server-side WebSocket header.
    assert wire_size(m.Extend("r1", 5, True, tuple(range(100)))) == 4 + 20 + 42 + 400


def test_wire_size_counts_a_virtual_chunk_as_the_kv_it_stands_for():
    real = m.KVChunk(SPAN, kv_payload(), 2, True)
    n = _encoded(real)
    assert wire_size(real) == ws_header_size(n, masked=False) + n
    virtual = m.KVSpan(SPAN.request_id, SPAN.layer_start, SPAN.layer_end, SPAN.token_start, SPAN.token_end,
                       SPAN.dtype, SPAN.shape, True)
    chunk = m.KVChunk(virtual, b"", 2, True)
    n = _encoded(chunk)
    assert frames.frame_size(chunk) == n
    assert wire_size(chunk) == ws_header_size(n, masked=False) + n + virtual.nbytes


def test_frame_size_refuses_what_encode_refuses():
    big = m.Error("r", "x", "é" * 4000)          # each é escapes to 2 bytes: fine
    assert frames.frame_size(big) == _encoded(big)
    # 16 error texts of 4000 control characters, each escaped to 6 bytes (\u0001): > 64 KiB of metadata.
    huge = m.PrefillDone("r", 1, 0, (0,) * 16, tuple("\x01" * 4000 for _ in range(16)), ())
    with pytest.raises(FrameTooLarge, match="exceeds 65535"):
        frames.encode(huge)
    with pytest.raises(FrameTooLarge, match="exceeds 65535"):
        frames.frame_size(huge)
