"""The one KV span / chunk type: what its constructor refuses, what it derives, and that the
value an engine exports is the value a link delivers."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from pddgw import messages as m
from pddgw.core.kv import KVChunk, KVSpan
from pddgw.core.roles import PIPELINES, ROLES, Pipeline, Role
from pddgw.net import frames

SPAN = KVSpan.of("r", tokens=(16, 24), layers=(1, 3), num_kv_heads=2, head_dim=4, dtype="float16")


def test_of_builds_the_wire_shape_and_the_sizes_follow():
    assert SPAN == KVSpan("r", 1, 3, 16, 24, "float16", (2, 2, 8, 2, 4))
    assert (SPAN.num_layers, SPAN.num_tokens, SPAN.num_kv_heads, SPAN.head_dim) == (2, 8, 2, 4)
    assert SPAN.nbytes == SPAN.payload_nbytes == 2 * 2 * 8 * 2 * 4 * 2
    virtual = dataclasses.replace(SPAN, virtual=True)
    assert (virtual.nbytes, virtual.payload_nbytes) == (512, 0)


@pytest.mark.parametrize("build, match", [
    (lambda: dataclasses.replace(SPAN, token_start=-1), "token_start out of range"),
    (lambda: dataclasses.replace(SPAN, layer_end=True), "layer_end must be an integer"),
    (lambda: dataclasses.replace(SPAN, token_end=16), "token_end must exceed token_start"),
    (lambda: dataclasses.replace(SPAN, token_end=25), r"shape\[2\] must equal token_end - token_start"),
    (lambda: dataclasses.replace(SPAN, dtype="int8"), "dtype 'int8' is not one of"),
    (lambda: dataclasses.replace(SPAN, shape=(2, 2, 8, 2, "4")), r"shape\[4\]: '4' out of range"),
    (lambda: dataclasses.replace(SPAN, request_id="x" * 257), "request_id longer than 256"),
    (lambda: KVSpan.of("r", tokens=(0, 8), layers=(0, 1), num_kv_heads=0, head_dim=4, dtype="float32"),
     "kv_heads and head_dim must be > 0"),
    (lambda: KVChunk(SPAN, bytes(SPAN.nbytes - 1)), f"payload has {SPAN.nbytes - 1} bytes, span needs 512"),
    (lambda: KVChunk(SPAN, memoryview(bytes(2 * SPAN.nbytes))[::2]), "payload must be C-contiguous"),
    (lambda: KVChunk(SPAN, bytes(SPAN.nbytes), seq=-1), "seq out of range"),
    (lambda: KVChunk(dataclasses.replace(SPAN, virtual=True), bytes(1)), "payload has 1 bytes, span needs 0"),
])
def test_a_malformed_span_or_chunk_never_exists(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_a_chunk_forwards_its_span_and_renumbering_revalidates():
    chunk = KVChunk(SPAN, bytearray(SPAN.nbytes))
    assert (chunk.request_id, chunk.token_start, chunk.token_end, chunk.layer_start, chunk.layer_end) == \
        ("r", 16, 24, 1, 3)
    assert (chunk.num_tokens, chunk.dtype, chunk.shape, chunk.virtual, chunk.nbytes, chunk.payload_nbytes) == \
        (8, "float16", (2, 2, 8, 2, 4), False, 512, 512)
    assert dataclasses.replace(chunk, seq=7).seq == 7
    with pytest.raises(ValueError, match="last must be a boolean"):
        dataclasses.replace(chunk, last=1)


def test_the_exported_chunk_is_the_delivered_chunk():
    """No converter between the engine and the link: the frame decodes to an equal span and the
    same bytes, as the very type the engine's import takes."""
    payload = bytes(i % 251 for i in range(512))
    sent = KVChunk(SPAN, memoryview(payload), seq=3, last=True)
    got = frames.decode(frames.encode_bytes(sent)).msg
    assert type(got) is KVChunk and got.span == SPAN and (got.seq, got.last) == (3, True)
    assert bytes(got.payload) == payload
    assert m.KINDS[m.KV_KIND] is KVChunk and m.KVSpan is KVSpan


def test_roles_are_one_vocabulary():
    assert ROLES == (Role.PREFILL, Role.RLD, Role.MD) == ("prefill", "rld", "md")
    assert tuple(Role) == ("router", "prefill", "rld", "md")
    assert PIPELINES == tuple(Pipeline) == ("P-MD", "P-RLD-MD", "P-RLD")
    assert orjson.dumps({"role": Role.MD, "pipeline": Pipeline.P_RLD_MD}) == b'{"role":"md","pipeline":"P-RLD-MD"}'
    assert f"{Role.PREFILL}/{Pipeline.P_MD}" == "prefill/P-MD"
