"""Incremental decode inputs against the list-based builder: identical tensors, identical tokens."""

from __future__ import annotations

import random

import pytest
import torch

from pddgw.engines.scheduler import Chunk
from pddgw.engines.sequence import Sequence
from pddgw.engines.step_inputs import IncrementalInputs, ListInputs
from pddgw.kernels import reference

from .conftest import make_engine, req


def _record(engine) -> list[dict]:
    """Wrap engine.inputs.build to keep a copy of every step's inputs."""
    log: list[dict] = []
    build = engine.inputs.build

    def recording(chunks):
        x = build(chunks)
        m = x.meta
        log.append({"input_ids": x.input_ids.clone(), "positions": x.positions.clone(),
                    "slot_mapping": m.slot_mapping.clone(), "block_tables": m.block_tables.clone(),
                    "cu_q_lens": m.cu_q_lens.clone(), "seq_lens": m.seq_lens.clone(),
                    "logits_rows": x.logits_rows.clone(), "is_decode": m.is_decode,
                    "to_sample": list(x.to_sample)})
        return x

    engine.inputs.build = recording
    return log


def _list_builder(engine) -> ListInputs:
    return ListInputs(engine.blocks.block_size, engine.device, engine.ops, engine._to_sample)


def _workload(engine) -> list[list]:
    """A scripted mix: prefills (chunked, cached prefixes), decodes, a held extend, an abort,
    early finishes, late joins, and block pressure (preemption).  -> outputs per step."""
    rng = random.Random(7)
    shared = [rng.randrange(32, 127) for _ in range(20)]

    def prompt(n, share=False):
        return (shared[:n] if share else []) + [rng.randrange(32, 127) for _ in range(n)]

    script = {
        0: [("add", f"a{i}", prompt(3 + 5 * i, share=i % 2 == 1), 12 + i) for i in range(5)],
        2: [("hold", "h", prompt(9), 20)],
        5: [("add", "s", prompt(6), 2)],                      # finishes almost at once
        7: [("append", "h", [40, 41, 42], False)],
        9: [("add", f"b{i}", prompt(2 + 3 * i, share=True), 15) for i in range(4)],
        12: [("abort", "a1")],
        14: [("append", "h", [43, 44], True)],
        20: [("add", f"c{i}", prompt(1 + 7 * i), 10) for i in range(3)],
    }
    steps, n = [], 0
    while n <= max(script) or engine.has_work():
        for op, rid, *args in script.get(n, ()):
            if op == "add":
                engine.add_request(req(rid, args[0], max_tokens=args[1]))
            elif op == "hold":
                engine.add_request(req(rid, args[0], max_tokens=args[1], output_token_ids=(50,), hold=True))
            elif op == "append":
                engine.append_tokens(rid, args[0], final=args[1])
            else:
                engine.abort(rid)
        steps.append([(o.request_id, o.ids, o.position, o.done, o.reason)
                      for o in engine.step()])
        n += 1
        assert n < 500
    return steps


@pytest.mark.parametrize("rows_blocks", [None, (3, 30), (8, 7)], ids=["default", "few-rows", "short-rows"])
def test_incremental_inputs_equal_list_inputs_on_a_mixed_workload(tiny64, rows_blocks):
    """Same tokens and, step by step, the same input tensors; also when the builder runs
    out of rows (more decoding sequences than rows) or a sequence outgrows its row."""
    kw = {"num_blocks": 30, "block_size": 4, "max_num_batched_tokens": 24, "max_num_seqs": 8}
    inc, ref = make_engine(tiny64, **kw), make_engine(tiny64, **kw)
    assert isinstance(inc.inputs, IncrementalInputs)
    if rows_blocks is not None:
        inc.inputs = IncrementalInputs(inc.blocks.block_size, inc.device, inc.ops, inc._to_sample,
                                       max_rows=rows_blocks[0], max_blocks=rows_blocks[1])
    ref.inputs = _list_builder(ref)
    log_inc, log_ref = _record(inc), _record(ref)
    out_inc, out_ref = _workload(inc), _workload(ref)

    assert out_inc == out_ref
    assert len(log_inc) == len(log_ref)
    for step, (a, b) in enumerate(zip(log_inc, log_ref)):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (step, k)
                assert torch.equal(a[k], b[k]), (step, k, a[k], b[k])
            else:
                assert a[k] == b[k], (step, k)
    # The workload did exercise what it claims to.
    builder = inc.inputs
    assert builder.num_fast > 3 and builder.num_fallback > 5 and builder.num_advanced > 1
    assert inc.stats().preemptions > 0 and inc.stats().preemptions == ref.stats().preemptions
    assert sum(1 for s in out_inc for o in s if o[4] == "abort") == 1
    inc.check_integrity()


def test_steady_decode_writes_only_new_blocks(tiny64):
    eng = make_engine(tiny64, num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    for i in range(8):
        eng.add_request(req(f"r{i}", [32 + i, 33, 34], max_tokens=13))
    eng.step()                                   # the prefills: list path
    builder = eng.inputs
    eng.step()                                   # first decode: rows written in full (1 block each)
    assert builder.num_fast == 1 and builder.num_row_writes == 8
    eng.step()                                   # position 4: every sequence gets its second block
    assert builder.num_row_writes == 16
    for _ in range(3):                           # positions 5..7: nothing new to write
        eng.step()
    assert builder.num_row_writes == 16 and builder.num_fast == 5 and builder.num_advanced == 4
    eng.step()                                   # position 8: third block each
    assert builder.num_row_writes == 24


def test_rows_are_reused_and_stale_entries_zeroed(tiny64):
    """A short sequence taking over a long one's row must not see its old blocks."""
    eng = make_engine(tiny64, num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=1)
    log = _record(eng)
    eng.add_request(req("long", list(range(40, 70)), max_tokens=3))
    while eng.has_work():
        eng.step()
    eng.add_request(req("short", [41, 42], max_tokens=3))
    while eng.has_work():
        eng.step()
    last = log[-1]
    assert last["block_tables"].shape == (1, 1)
    assert eng.inputs.table[0, 1:].eq(0).all()


def _chunk(prompt: int, done: int, computed: int, new: int) -> Chunk:
    """A chunk of `new` tokens from `computed` of a sequence with `prompt` prompt tokens and `done`
    generated ones (blocks 0.. of 4 tokens)."""
    seq = Sequence(req("r", range(1, prompt + 1), output_token_ids=tuple(range(100, 100 + done))))
    seq.num_computed = computed
    seq.block_ids = list(range(-(-(prompt + done) // 4)))
    return Chunk(seq, new)


@pytest.mark.parametrize("chunks,is_decode,generated", [
    ([(5, 1, 5, 1), (6, 3, 8, 1)], True, None),                    # decodes only
    ([(5, 1, 5, 1), (9, 0, 0, 9)], False, [1, 0]),                 # a decode beside a prefill
    ([(9, 0, 8, 1)], False, None),                                 # a prompt's last token alone
    ([(9, 0, 8, 1), (5, 1, 5, 1)], False, [0, 1]),                 # ... beside a decode
    ([(6, 4, 4, 6)], False, [4]),                                  # 2 prompt tokens, then 4 relayed
    ([(6, 4, 7, 3)], False, [3]),                                  # relayed tokens only, 3 of them
])
def test_the_step_says_which_new_tokens_are_generated(chunks, is_decode, generated):
    """A decode is one new token past the prompt; the extend kernel is told how many of each
    sequence's new tokens are generated (the last ones), the prompt's last token is not one."""
    built = ListInputs(4, torch.device("cpu"), reference, lambda c: False).build([_chunk(*c) for c in chunks])
    assert built.meta.is_decode is is_decode
    assert (built.meta.generated.tolist() if built.meta.generated is not None else None) == generated


def test_a_prompt_s_last_token_alone_is_not_a_decode_batch(tiny64):
    """The incremental builder takes decode batches only: a one-token chunk of a prompt (the
    rest cached or chunked) goes to the list builder, which does not call it a decode."""
    eng = make_engine(tiny64, max_num_batched_tokens=8, max_num_seqs=4)
    eng.add_request(req("a", range(1, 10), max_tokens=2))          # 9 tokens in chunks of 8: 8, then 1
    log = _record(eng)
    fallback = eng.inputs.num_fallback
    while eng.has_work():
        eng.step()
    assert [e["is_decode"] for e in log] == [False, False, True]
    assert eng.inputs.num_fallback == fallback + 2
