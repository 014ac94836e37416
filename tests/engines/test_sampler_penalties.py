"""Penalties from per-sequence counts (`TokenCounts`, `_penalize`): bit for bit the dense formulas.

`dense_reference` is the dense implementation the sparse one replaced, kept here as the
reference: every entry of every penalized row computed as [P, V] tensors, the counts
accumulated by an index_put of ones in the logits' dtype.  Results are compared bit for bit
(their integer views: -0.0 and +0.0 told apart).
"""

import itertools
import random

import pytest
import torch

import pddgw.engines.torch_engine as torch_engine_mod
from pddgw.engines.penalties import TokenCounts, TokenHistory, adjust_logits
from pddgw.engines.sampler import sample
from pddgw.engines.types import EngineRequest, SamplingParams
from tests.engines.conftest import make_engine, run_to_end

BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
        torch.float16: torch.int16}


def dense_reference(logits, params, positions, histories, eos=()):
    """Steps 1-4 of `adjust_logits` over whole [P, V] rows: the reference."""
    n, vocab = logits.shape
    rows = [i for i in range(n) if params[i].penalized or params[i].logit_bias or positions[i] < params[i].min_tokens]
    if not rows:
        return logits
    dev = logits.device
    i64 = dict(dtype=torch.int64, device=dev)
    index = torch.tensor(rows, **i64)
    x = logits.index_select(0, index)
    ps = [params[i] for i in rows]
    bias = [(j, t, b) for j, p in enumerate(ps) for t, b in p.logit_bias]
    if bias:
        bj, bt, bb = zip(*bias)
        x.index_put_((torch.tensor(bj, **i64), torch.tensor(bt, **i64)), torch.tensor(bb, dtype=x.dtype, device=dev),
                     accumulate=True)
    stops = [(j, t) for j, (i, p) in enumerate(zip(rows, ps)) if positions[i] < p.min_tokens
             for t in sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))) if t < vocab]
    if stops:
        sj, st = zip(*stops)
        x[torch.tensor(sj, **i64), torch.tensor(st, **i64)] = float("-inf")

    def row_ids(lists):
        lens = torch.tensor([len(t) for t in lists], dtype=torch.int64)
        ids = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64)
        return torch.repeat_interleave(torch.arange(len(lists)), lens).to(dev), ids.to(dev)

    pen = [j for j, p in enumerate(ps) if p.penalized]
    if pen:
        hist = [histories[rows[j]] for j in pen]
        count = torch.zeros(len(pen), vocab, dtype=x.dtype, device=dev)
        count.index_put_(row_ids([h.tokens[h.num_prompt:] for h in hist]), torch.ones((), dtype=x.dtype, device=dev),
                         accumulate=True)
        seen = out_seen = count > 0
        rep = [k for k, j in enumerate(pen) if ps[j].repetition_penalty != 1.0]
        if rep:
            seen = seen.clone()
            seen[row_ids([hist[k].tokens[: hist[k].num_prompt] if k in rep else () for k in range(len(pen))])] = True
        pidx = torch.tensor(pen, **i64)
        y = x.index_select(0, pidx)
        f = dict(dtype=x.dtype, device=dev)
        r = torch.tensor([ps[j].repetition_penalty for j in pen], **f)[:, None]
        y = torch.where(seen, torch.where(y > 0, y / r, y * r), y)
        y = y - torch.tensor([ps[j].frequency_penalty for j in pen], **f)[:, None] * count
        y = y - torch.tensor([ps[j].presence_penalty for j in pen], **f)[:, None] * out_seen
        x.index_copy_(0, pidx, y)
    return logits.index_copy(0, index, x)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype])


def random_case(seed: int, dtype: torch.dtype, n: int = 12, vocab: int = 300):
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    x = torch.randn(n, vocab, generator=g) * 3
    x[:, 10:40] = torch.randint(-3, 4, (n, 30), generator=g).float()   # ties, exact zeros ...
    x[:, 40:50] = -0.0                                                 # ... negative zeros
    x[::3, 50] = float("-inf")
    x[1::4, 51] = float("inf")
    x = x.to(dtype)
    params, hist = [], []
    for i in range(n):
        pen = dict(repetition_penalty=rnd.choice([1.0, 1.3, 0.7, 2.0]),
                   frequency_penalty=rnd.choice([0.0, 0.5, -0.5, 1.7, -0.0]),
                   presence_penalty=rnd.choice([0.0, 0.4, -1.0, 2.0]))
        if i % 5 == 4:
            pen = {}                                                   # no penalty in this row
        extra = {}
        if i % 3 == 1:
            extra = dict(logit_bias={rnd.randrange(vocab): 2.5, 45: -1.0}, min_tokens=rnd.choice([0, 30]),
                         stop_token_ids=(rnd.randrange(vocab),))
        params.append(SamplingParams(temperature=0.9, seed=i, **pen, **extra))
        num_prompt = rnd.randrange(0, 40)
        pool = rnd.sample(range(vocab), rnd.choice([5, 20, 60]))        # few distinct tokens: repeats
        tokens = [rnd.choice(pool) for _ in range(num_prompt + rnd.randrange(0, 60))]
        hist.append(TokenHistory(tokens, num_prompt))
    positions = [len(h.tokens) - h.num_prompt for h in hist]
    return x, params, positions, hist


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_penalties_from_counts_equal_the_dense_reference_bit_for_bit(dtype):
    for seed in range(40):
        x, params, positions, hist = random_case(seed, dtype)
        ref = dense_reference(x, params, positions, hist, eos=(3,))
        got = adjust_logits(x, params, positions, hist, (3,))
        assert torch.equal(bits(got), bits(ref)), seed
        # Kept counts (a sequence's `TokenCounts`) and in place: the same bits; in place changes x itself.
        kept = [TokenHistory(h.tokens, h.num_prompt, TokenCounts(h.tokens, h.num_prompt)) for h in hist]
        y = x.clone()
        assert adjust_logits(y, params, positions, kept, (3,), inplace=True) is y
        assert torch.equal(bits(y), bits(ref)), seed
        # One row alone: the same bits as in the batch.
        for i in (0, 5, 11):
            alone = adjust_logits(x[i : i + 1], params[i : i + 1], positions[i : i + 1], hist[i : i + 1], (3,))
            assert torch.equal(bits(alone[0]), bits(ref[i])), (seed, i)


@pytest.mark.parametrize("dtype,top", [(torch.bfloat16, 256), (torch.float16, 2048), (torch.float32, 1 << 24)])
def test_counts_past_the_dtypes_exact_integers_saturate_as_an_accumulating_index_put(dtype, top):
    # A token drawn 2100 times: a bfloat16 count of ones stops at 256 (257 rounds back to it), a
    # float16 one at 2048; float32 counts it exactly.
    x = torch.zeros(2, 8, dtype=dtype)
    sp = SamplingParams(frequency_penalty=0.5)
    hist = [TokenHistory([1, 2] + [5] * 2100 + [6] * 3, 2), TokenHistory([1, 5, 6], 1)]
    got = adjust_logits(x, [sp, sp], [2103, 2], hist)
    assert torch.equal(bits(got), bits(dense_reference(x, [sp, sp], [2103, 2], hist)))
    assert got[0, 5].item() == -0.5 * min(2100, top) and got[0, 6].item() == -1.5 and got[1, 5].item() == -0.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_penalties_equal_the_dense_reference_on_cuda(dtype):
    # Counts past the dtype's exact integers included: the reference's accumulating index_put runs on CUDA too.
    for seed in range(10):
        x, params, positions, hist = random_case(seed, dtype)
        x = x.cuda()
        assert torch.equal(bits(adjust_logits(x, params, positions, hist, (3,))),
                           bits(dense_reference(x, params, positions, hist, eos=(3,))))
    sp = SamplingParams(frequency_penalty=0.5)
    hist = [TokenHistory([1, 2] + [5] * 2100 + [6] * 3, 2)]
    x = torch.zeros(1, 8, dtype=dtype, device="cuda")
    assert torch.equal(bits(adjust_logits(x, [sp], [2103], hist)), bits(dense_reference(x, [sp], [2103], hist)))


def test_token_counts_grow_with_the_tokens_as_a_fresh_count_would_give():
    rnd = random.Random(3)
    prompt = [rnd.randrange(50) for _ in range(30)]
    tokens = list(prompt)
    counts = TokenCounts(tokens, len(prompt))
    assert list(counts.ids) == list(dict.fromkeys(prompt)) and set(counts.prompt) == {1} and counts.top == 0
    for step in range(40):
        # Decodes, handoff extends (several tokens, repeats among them), a long one counted at once.
        tokens += [rnd.randrange(60) for _ in range(1 if step % 4 else 5 if step % 20 else 30)]
        counts.sync(tokens)
        fresh = TokenCounts(tokens, len(prompt))
        assert (counts.ids, counts.prompt, counts.counts, counts.top) == (fresh.ids, fresh.prompt, fresh.counts,
                                                                          fresh.top)
    out = tokens[len(prompt):]
    assert dict(zip(counts.ids, counts.counts)) == {t: out.count(t) for t in set(prompt) | set(out)}
    assert counts.top == max(out.count(t) for t in out)
    with pytest.raises(RuntimeError, match="only grow"):
        counts.sync(tokens[:-1])


def penalized(i: int, n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.9, seed=40 + i, repetition_penalty=1.4, presence_penalty=0.6,
                          frequency_penalty=0.3 * (i % 3), ignore_eos=True)


def test_engine_adjusts_every_step_as_the_dense_reference(tiny64, monkeypatch):
    # Every step of a penalized batch (some rows with logit_bias, one plain): the engine's in-place,
    # kept-counts adjustment is bit for bit the dense reference on the model's own logits.
    real, checked = torch_engine_mod.adjust_logits, []

    def checking(logits, params, positions, seqs, eos, cons, inplace=False):
        ref = dense_reference(logits.clone(), params, positions,
                              [TokenHistory(list(s.tokens), s.num_prompt) for s in seqs], eos)
        got = real(logits, params, positions, seqs, eos, cons, inplace=inplace)
        assert torch.equal(bits(got), bits(ref))
        checked.append(len(seqs))
        return got

    monkeypatch.setattr(torch_engine_mod, "adjust_logits", checking)
    eng = make_engine(tiny64)
    rnd = random.Random(5)
    for i in range(5):
        sp = penalized(i, 20)
        if i == 3:
            sp = SamplingParams(max_tokens=20, temperature=0.9, seed=43, ignore_eos=True, logit_bias={7: 3.0})
        eng.add_request(EngineRequest(f"r{i}", tuple(rnd.randrange(32, 127) for _ in range(12 + i)), sp))
    out = run_to_end(eng)
    assert all(len(t) == 20 for t in out.values()) and max(checked) == 5 and len(checked) >= 20
    eng.check_integrity()


def test_penalized_tokens_are_the_same_through_preemption_and_given_outputs(tiny64):
    # A pool too small for the batch preempts (the sequences recompute, their counts kept); a request
    # re-driven with its first outputs given at admission counts them as output: the same tokens.
    prompts = [[random.Random(i).randrange(32, 127) for _ in range(30)] for i in range(6)]

    def run(**cfg):
        eng = make_engine(tiny64, **cfg)
        for i, p in enumerate(prompts):
            eng.add_request(EngineRequest(f"r{i}", tuple(p), penalized(i, 25)))
        out = run_to_end(eng)
        eng.check_integrity()
        return out, eng.stats().preemptions

    roomy, none = run()
    tight, some = run(num_blocks=12, block_size=8, max_num_batched_tokens=64)
    assert none == 0 < some and tight == roomy
    eng = make_engine(tiny64)
    eng.add_request(EngineRequest("g", tuple(prompts[2]), penalized(2, 25), output_token_ids=tuple(roomy["r2"][:9])))
    assert run_to_end(eng)["g"] == roomy["r2"][9:]


def test_a_sequence_keeps_its_counts_up_to_each_draw(tiny64):
    eng = make_engine(tiny64)
    eng.add_request(EngineRequest("p", (40, 41, 41, 42), penalized(0, 6)))
    eng.add_request(EngineRequest("q", (40, 41), SamplingParams(max_tokens=6, temperature=0.9, seed=1)))
    seq = eng.seqs["p"]
    assert eng.seqs["q"].counts is None                          # no penalties: nothing kept
    assert (list(seq.counts.ids), list(seq.counts.counts)) == ([40, 41, 42], [0, 0, 0])
    kept = seq.counts
    for _ in range(5):
        eng.step()
        drawn_from = TokenCounts(seq.tokens[:-1], seq.num_prompt)  # the tokens before the last draw
        assert seq.counts is kept and (kept.ids, kept.counts) == (drawn_from.ids, drawn_from.counts)
    run_to_end(eng)
    assert not eng.seqs                                           # gone with its sequence


def test_sampling_after_penalties_equals_sampling_after_the_dense_reference():
    # The end to end contract: the same tokens as before, for many rows and seeds.
    for seed in range(10):
        x, params, positions, hist = random_case(100 + seed, torch.float32, n=16, vocab=2000)
        x = torch.nan_to_num(x, posinf=30.0)
        params = [SamplingParams(temperature=0.8, top_p=(0.95, 1.0, 0.7)[i % 3], top_k=(0, 40)[i % 2], seed=seed + i,
                                 repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
                                 presence_penalty=p.presence_penalty) for i, p in enumerate(params)]
        ref = sample(dense_reference(x, params, positions, hist), params, positions)
        assert sample(adjust_logits(x, params, positions, hist), params, positions) == ref
