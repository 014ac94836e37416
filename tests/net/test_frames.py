"""Frame codec: exact layout, round trips of every kind, strict validation, fuzzing."""

from __future__ import annotations

import struct

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from net_samples import SPAN, every_message, kv_payload, same

from pddgw import messages as m
from pddgw.core.sampling import SamplingParams
from pddgw.net import frames
from pddgw.net.errors import FrameError, FrameTooLarge
from pddgw.net.wsproto import ws_header_size


@pytest.mark.parametrize("msg", every_message(), ids=lambda x: x.tag)
def test_round_trip_every_kind(msg):
    data = frames.encode_bytes(msg, corr=77, seq=5, flags=frames.FLAG_REPLY)
    frame = frames.decode(data)
    assert same(frame.msg, msg)
    assert (frame.head.kind, frame.head.corr, frame.head.seq, frame.head.is_reply) == (
        m.KIND_OF[type(msg)], 77, 5, True)
    assert frame.head.size == len(data)


def test_every_kind_has_a_sample():
    net_kinds = {cls for kind, cls in m.KINDS.items() if kind < 100}   # 100+ belong to the pipeline
    assert {type(x) for x in every_message()} == net_kinds


def test_header_layout_is_pinned():
    msg = m.Ack("r", 3)
    data = frames.encode_bytes(msg, corr=0x01020304, seq=0x0A0B0C0D)
    meta = b'{"request_id":"r","seq":3,"detail":""}'
    assert data == (b"PD\x01\x15\x00\x00" + struct.pack("<H", len(meta)) + bytes([4, 3, 2, 1])
                    + bytes([0x0D, 0x0C, 0x0B, 0x0A]) + b"\x00\x00\x00\x00" + meta)


def test_kv_payload_is_raw_and_zero_copy_both_ways():
    payload = kv_payload()
    head, view = frames.encode(m.KVChunk(SPAN, payload, 1, False))
    assert view.obj is payload                      # encode does not copy the tensor memory
    data = bytearray(head + payload)
    frame = frames.decode(data)
    assert frame.msg.payload.obj is data            # decode hands out a view into the frame
    assert bytes(frame.msg.payload) == bytes(payload)


def test_token_ids_are_packed_int32_and_fit_five_bytes_a_token():
    msg = m.TokenIds("0123456789abcdef0123456789abcdef", 4096, tuple(range(1000, 1100)))
    head, payload = frames.encode(msg)
    assert bytes(payload) == struct.pack("<100i", *range(1000, 1100))
    frame_len = len(head) + len(payload)
    assert frame_len == frames.HEADER_SIZE + len(b'{"request_id":"0123456789abcdef0123456789abcdef",'
                                                 b'"start":4096}') + 400
    # On the wire, with the WebSocket header and the client's mask key.
    assert frame_len + ws_header_size(frame_len, masked=True) <= 5 * 100


def test_prefix_hashes_are_packed_uint64():
    head, payload = frames.encode(m.PrefixQuery("q", (1, (1 << 64) - 1)))
    assert bytes(payload) == struct.pack("<QQ", 1, (1 << 64) - 1)


def _frame(kind: int, meta: bytes, payload: bytes = b"", *, magic=b"PD", version=1, flags=0, reserved=0,
           meta_len=None, payload_len=None) -> bytes:
    return frames.HEADER.pack(magic, version, kind, flags, reserved, len(meta) if meta_len is None else meta_len,
                              0, 0, len(payload) if payload_len is None else payload_len) + meta + payload


GOOD_READY = b'{"request_id":"r","detail":""}'
BATCH_META = orjson.dumps({"request_ids": ["a"], "positions": [0], "counts": [2], "done": [False],
                           "reasons": [""]})
KV_META = orjson.dumps({"request_id": "r", "layer_start": 0, "layer_end": 1, "token_start": 0, "token_end": 1,
                        "dtype": "float32", "shape": [1, 2, 1, 1, 2], "virtual": False, "seq": 0,
                        "last": False})


@pytest.mark.parametrize("data, match", [
    (b"PD\x01", "shorter than"),
    (_frame(20, GOOD_READY, magic=b"XX"), "bad magic"),
    (_frame(20, GOOD_READY, version=2), "unsupported protocol version 2"),
    (_frame(99, GOOD_READY), "unknown frame kind 99"),
    (_frame(20, GOOD_READY, flags=0x80), "unknown flags"),
    (_frame(20, GOOD_READY, reserved=1), "reserved byte"),
    (_frame(20, GOOD_READY, meta_len=5), "header says"),
    (_frame(20, GOOD_READY) + b"x", "header says"),
    (_frame(20, GOOD_READY, b"xy"), "carries no payload"),
    (_frame(20, b"{not json"), "not valid JSON"),
    (_frame(20, b"[1,2]"), "must be a JSON object"),
    (_frame(20, b'{"request_id":"r"}'), r"missing \['detail'\]"),
    (_frame(20, b'{"request_id":"r","detail":"","x":1}'), r"unknown \['x'\]"),
    (_frame(20, b'{"request_id":5,"detail":""}'), "request_id must be a string"),
    (_frame(21, b'{"request_id":"r","seq":true,"detail":""}'), "seq must be an integer"),
    (_frame(21, b'{"request_id":"r","seq":-1,"detail":""}'), "seq out of range"),
    (_frame(11, b'{"request_id":"r","start":0}', b"\x01\x02\x03"), "not whole items"),
    (_frame(11, b'{"request_id":"r","start":0}', struct.pack("<i", -5)), "out of range"),
    (_frame(10, KV_META, b"\x00" * 15), "payload has 15 bytes, span needs 16"),
    (_frame(10, KV_META.replace(b'"float32"', b'"int4"'), b"\x00" * 16), "dtype 'int4'"),
    (_frame(10, KV_META.replace(b"[1,2,1,1,2]", b"[1,3,1,1,2]"), b"\x00" * 24), "shape\\[1\\] must be 2"),
    (_frame(10, KV_META.replace(b'"layer_end":1', b'"layer_end":0'), b"\x00" * 16), "layer_end must exceed"),
    (_frame(10, KV_META.replace(b"[1,2,1,1,2]", b"[[1],2,1,1,2]"), b"\x00" * 16), "out of range"),
    (_frame(30, orjson.dumps({"node": "n", "running": 0, "waiting": 0, "free_blocks": 5, "total_blocks": 4,
                              "kv_bytes_in_flight": 0, "tokens_per_s": 1.0})), "free_blocks must be <="),
    (_frame(1, orjson.dumps({"node": "n", "link_id": "l", "stripe": 3, "stripes": 3, "nonce": "0" * 64,
                             "shaping": ""})), "stripe out of range"),
    (_frame(3, b'{"proof":"XYZ"}'), "64 lowercase hex"),
    (_frame(13, BATCH_META, b"\x01\x00\x00\x00"), "summing to the payload's 1 ids"),
    (_frame(13, BATCH_META.replace(b'"request_ids":["a"]', b'"request_ids":["a","b"]'), b"\x00" * 8),
     "lists of one length"),
    (_frame(13, orjson.dumps({"request_ids": [], "positions": [], "counts": [], "done": [], "reasons": []})),
     "lists of one length"),
    (_frame(13, BATCH_META.replace(b'"counts":[2]', b'"counts":[-1]'), b""), "counts must be ints"),
    (_frame(13, BATCH_META.replace(b'"done":[false]', b'"done":[1]'), b"\x00" * 8), "done must be a boolean"),
    (_frame(13, BATCH_META, b"\x00" * 6), "not whole items"),
])
def test_malformed_frames_raise_frame_error(data, match):
    with pytest.raises(FrameError, match=match):
        frames.decode(data)


def test_size_limits():
    big = frames.encode_bytes(m.KVChunk(SPAN, kv_payload()))
    with pytest.raises(FrameTooLarge, match="exceeds the limit"):
        frames.decode(big, max_frame=len(big) - 1)
    assert same(frames.decode(big, max_frame=len(big), max_control=64).msg, m.KVChunk(SPAN, kv_payload()))
    ctl = frames.encode_bytes(m.Ready("r", "x" * 100))
    with pytest.raises(FrameTooLarge):
        frames.decode(ctl, max_control=len(ctl) - 1)


def _prefill(**fields) -> m.Prefill:
    return m.Prefill(request_id="r", targets=("rld0", "md0"), starts=(0, 0), prompt=(1, 2, 3),
                     sampling=SamplingParams(), **fields)


def test_prefill_names_each_targets_block_size():
    msg = _prefill(blocks=[16, 32])
    assert msg.blocks == (16, 32)
    assert frames.decode(frames.encode_bytes(msg)).msg == msg
    assert _prefill().blocks == ()


@pytest.mark.parametrize("build, match", [
    (lambda: m.TokenBatch(()), "between 1 and 4096"),
    (lambda: m.TokenBatch(tuple(m.TokenItem("r", 0, ()) for _ in range(m.MAX_BATCH_ITEMS + 1))),
     "between 1 and 4096"),
    (lambda: m.TokenBatch([m.TokenItem("r", 0, ())]), "tuple of TokenItem"),
    (lambda: m.TokenBatch((m.Ready("r"),)), "must be TokenItems"),
    (lambda: m.TokenBatch((m.TokenItem("a", 0, (1,) * m.MAX_TOKEN_IDS), m.TokenItem("b", 0, (2,)))),
     "more than"),
    (lambda: m.KVChunk(SPAN, bytearray(SPAN.nbytes - 1)), "span needs"),
    (lambda: m.KVChunk(SPAN, memoryview(bytearray(SPAN.nbytes * 2))[::2]), "C-contiguous"),
    (lambda: m.TokenIds("r", 0, (1 << 31,)), "out of range"),
    (lambda: m.TokenItem("r", 0, [1, "2"]), "out of range"),
    (lambda: m.LoadReport("n", 0, 0, 0, 1, 0, float("nan")), "finite"),
    (lambda: m.Error("r", ""), "code must not be empty"),
    (lambda: m.KVSpan("r", 0, 1, 0, 1, "float32", (1, 2, 1, 1)), "shape must be"),
    (lambda: m.Hello("n", "l", 0, 17, "0" * 64), "stripes out of range"),
    (lambda: _prefill(blocks=(16,)), "blocks must have one entry per target"),
    (lambda: _prefill(blocks=(16, 24)), "blocks must be powers of two"),
    (lambda: _prefill(blocks=(0, 16)), "blocks must be powers of two"),
    (lambda: _prefill(blocks=(16, 1 << 17)), "out of range"),
])
def test_messages_validate_on_construction(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_sequences_normalise_to_tuples():
    assert m.TokenIds("r", 0, [1, 2]).ids == (1, 2)
    assert m.KVSpan("r", 0, 1, 0, 1, "float32", [1, 2, 1, 1, 1]).shape == (1, 2, 1, 1, 1)


# ---------------------------------------------------------------------------
# Fuzzing: any bytes give a Frame or a FrameError, never another exception.

VALID = [frames.encode_bytes(x) for x in every_message()]
NET_KINDS = sorted(k for k in m.KINDS if k < 100)


def _decode_total(data: bytes) -> None:
    try:
        frames.decode(data, max_frame=1 << 20, max_control=1 << 16)
    except FrameError:
        pass


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_fuzz_arbitrary_bytes(data):
    _decode_total(data)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(VALID), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=8),
       st.integers(0, 10_000), st.binary(max_size=16))
def test_fuzz_mutated_frames(base, flips, cut, tail):
    data = bytearray(base)
    for pos, val in flips:
        data[pos % len(data)] = val
    _decode_total(bytes(data[: max(0, len(data) - cut % 8)]) + tail)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(NET_KINDS), st.data(), st.binary(max_size=64))
def test_fuzz_well_framed_hostile_metadata(kind, data, payload):
    """Right header and field names, arbitrary field values: only FrameError."""
    schema = frames._SCHEMAS[kind]
    meta = {name: data.draw(JSON_VALUES) for name in schema.meta_order}
    try:
        raw = orjson.dumps(meta)
    except (orjson.JSONEncodeError, TypeError):
        return
    _decode_total(_frame(kind, raw, payload))


