"""Position-keyed sampling: same (seed, position, logits) -> same token, anywhere, batched on the device."""

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

import pddgw.engines.sampler as sampler_mod
from pddgw.engines.sampler import (_at_least, _blocked_probs, _cut_base, _drop, _prefix_candidates, _prefix_draw,
                                   _probs, _Rows, _sample_rows, _sample_speculative, _second_floor, _Softmax,
                                   first_argmax, logprobs,
                                   position_uniform, position_uniforms, sample, sample_ids, sample_one)
from pddgw.engines.types import RequestError, SamplingParams

M64 = (1 << 64) - 1


def reference_uniform(seed: int, position: int) -> float:
    """SplitMix64 written out on unsigned Python integers, independently of the module."""
    def mix(z: int) -> int:
        z ^= z >> 30
        z = (z * 0xBF58476D1CE4E5B9) % 2**64
        z ^= z >> 27
        z = (z * 0x94D049BB133111EB) % 2**64
        return z ^ (z >> 31)
    state = mix(seed)
    z = mix((state + (position + 1) * 0x9E3779B97F4A7C15) % 2**64)
    return (z >> 11) * 2.0**-53


# ---- the draw ---------------------------------------------------------------------------------------
def hash_pairs() -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(1)
    seeds = [0, 1, 2, 3, 12345, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 2, 2**63 - 1]
    seeds += [int(s) for s in torch.randint(0, 2**63 - 1, (60,), generator=g)]
    positions = [0, 1, 2, 7, 1000, 2**20, 2**31 - 1, 2**32 + 5]
    positions += [int(p) for p in torch.randint(0, 2**40, (10,), generator=g)]
    return [(s, p) for s in seeds for p in positions]


def test_device_hash_is_bit_identical_to_the_python_reference():
    pairs = hash_pairs()
    seeds = torch.tensor([s for s, _ in pairs], dtype=torch.int64)
    positions = torch.tensor([p for _, p in pairs], dtype=torch.int64)
    batched = position_uniforms(seeds, positions)
    assert batched.dtype == torch.float64
    ref = [reference_uniform(s, p) for s, p in pairs]
    assert batched.tolist() == ref                                   # exact float equality, every pair
    assert [position_uniform(s, p) for s, p in pairs] == ref         # the scalar agrees bit for bit
    assert all(0.0 <= u < 1.0 for u in ref) and len(set(ref)) == len(ref)


def test_a_run_of_positions_draws_bit_identically_to_one_position_at_a_time():
    # The cost-model engine's draw of a request's answer in one call: one seed, a run of positions
    # (every seed SamplingParams admits: below 2**63).
    for seed in (0, 7, 2**62 + 3, 2**63 - 1):
        for start in (0, 1000, 2**32 + 5):
            run = position_uniforms(torch.full((300,), seed, dtype=torch.int64), torch.arange(start, start + 300))
            assert run.tolist() == [position_uniform(seed, p) for p in range(start, start + 300)]


def test_pinned_draws():
    # Pins the function itself: changing it changes every seeded output of the system.
    assert reference_uniform(0, 0) == position_uniform(0, 0) == (0xE220A8397B1DCDAF >> 11) * 2.0**-53
    assert position_uniform(7, 3) != position_uniform(8, 3) != position_uniform(7, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_hash_matches_cpu():
    pairs = hash_pairs()
    seeds = torch.tensor([s for s, _ in pairs], dtype=torch.int64)
    positions = torch.tensor([p for _, p in pairs], dtype=torch.int64)
    on_cuda = position_uniforms(seeds.cuda(), positions.cuda()).cpu()
    assert on_cuda.tolist() == position_uniforms(seeds, positions).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rows_sample_the_same_alone_and_in_a_batch():
    g = torch.Generator().manual_seed(6)
    batch = (torch.randn(32, 50000, generator=g) * 3).cuda()
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i) if i % 4 == 0 else
              SamplingParams(temperature=1.0, top_k=40, min_p=0.02, seed=i) if i % 4 == 1 else
              SamplingParams(temperature=0.7, seed=i) if i % 4 == 2 else SamplingParams() for i in range(32)]
    together = sample(batch, params, list(range(32)))
    assert together == [sample_one(batch[i], params[i], i) for i in range(32)]


def test_position_uniform_depends_only_on_seed_and_position():
    assert position_uniform(7, 3) == position_uniform(7, 3)
    draws = {position_uniform(7, i) for i in range(100)}
    assert len(draws) == 100 and all(0.0 <= u < 1.0 for u in draws)
    assert position_uniform(7, 3) != position_uniform(8, 3)


# ---- greedy -----------------------------------------------------------------------------------------
def test_greedy_picks_first_max():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits, [SamplingParams(), SamplingParams()], [0, 0]) == [1, 0]


def test_greedy_equals_argmax_alone_and_in_a_mixed_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randint(0, 8, (16, 500), generator=g).to(torch.float32)   # many ties
    params = [SamplingParams() if i % 3 else SamplingParams(temperature=0.8, top_k=20 * (i % 2), seed=i)
              for i in range(16)]
    got = sample(logits, params, list(range(16)))
    argmax = torch.argmax(logits, dim=-1).tolist()
    assert [t for t, p in zip(got, params) if p.greedy] == [a for a, p in zip(argmax, params) if p.greedy]
    assert sample(logits, [SamplingParams()] * 16, [0] * 16) == argmax


@pytest.mark.parametrize("vocab", [512, 1000, 32000, 32001])
def test_first_argmax_picks_pinned_first_maxima(vocab):
    x = torch.zeros(8, vocab)
    x[0, 129] = x[0, 700 % vocab] = 1.0             # tie across chunks: the first
    x[1, vocab - 1] = 2.0                           # in the last, possibly narrow, chunk
    x[2, 5] = x[2, vocab - 2] = float("nan")        # NaN is the largest: the first NaN
    x[3] = float("-inf")                            # nothing finite: column 0
    x[4, 127] = x[4, 128] = 3.0                     # tie on a chunk boundary
    x[5, 300] = float("inf")
    x[6, vocab - 2 :] = 4.0                         # tie at the very end
    # row 7: all zeros, column 0
    expected = [129, vocab - 1, 5, 0, 127, 300, vocab - 2, 0]
    assert first_argmax(x).tolist() == expected
    assert torch.argmax(x, dim=-1).tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("vocab", [511, 512, 4097, 32000, 50257])
def test_first_argmax_is_argmax_on_tie_heavy_rows(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randint(0, 6, (24, vocab), generator=g).to(dtype)        # every row ties many times
    assert torch.equal(first_argmax(x), torch.argmax(x, dim=-1))
    assert torch.equal(first_argmax(x[1::3]), torch.argmax(x[1::3], dim=-1))   # strided rows


# ---- the inverse CDF and the filters ----------------------------------------------------------------
def test_inverse_cdf_matches_the_uniform():
    # Three tokens with probabilities 0.5, 0.3, 0.2 (sorted order 0, 1, 2).
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))
    p = SamplingParams(temperature=1.0, seed=5)
    for pos in range(30):
        u = position_uniform(5, pos)
        expected = 0 if u < 0.5 else 1 if u < 0.8 else 2
        assert sample_one(logits, p, pos) == expected


def test_top_k_top_p_and_min_p_filters():
    logits = torch.log(torch.tensor([0.1, 0.5, 0.15, 0.25], dtype=torch.float64))
    top1 = SamplingParams(temperature=1.0, top_k=1, seed=1)
    assert {sample_one(logits, top1, i) for i in range(20)} == {1}
    # top_p 0.7: sorted 0.5 (id 1), 0.25 (id 3) reach 0.75 >= 0.7; ids 0 and 2 never drawn.
    nucleus = SamplingParams(temperature=1.0, top_p=0.7, seed=1)
    assert {sample_one(logits, nucleus, i) for i in range(200)} == {1, 3}
    top2 = SamplingParams(temperature=1.0, top_k=2, seed=1)
    assert {sample_one(logits, top2, i) for i in range(200)} == {1, 3}
    # min_p 0.3: keep p >= 0.15 -> ids 1, 3, 2.
    minp = SamplingParams(temperature=1.0, min_p=0.3, seed=1)
    assert {sample_one(logits, minp, i) for i in range(200)} == {1, 2, 3}


def test_min_p_is_validated():
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(RequestError):
            SamplingParams(temperature=1.0, min_p=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_top_k_path_equals_full_sort_path(dtype):
    # Ties everywhere (integer logits): a row's candidates are (logit desc, id asc) on every path and bound.
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-6, 6, (64, 300), generator=g).to(dtype) * 0.5
    for k in (1, 5, 40):
        params = [SamplingParams(temperature=0.9, top_k=k, top_p=0.9 if i % 2 else 1.0, min_p=0.01 * (i % 3), seed=i)
                  for i in range(64)]
        pos = list(range(64))
        full = _sample_rows(x, params, pos, 0)
        assert torch.equal(_sample_rows(x, params, pos, k), full)
        assert torch.equal(_sample_rows(x, params, pos, 3 * k), full)


def test_unfiltered_rows_need_no_sort_and_match_the_sorted_cdf_on_sorted_rows():
    x = torch.tensor([[3.0, 2.0, 1.0, 0.5, -1.0]] * 300)
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(300)]
    pos = [i % 7 for i in range(300)]
    assert torch.equal(_sample_rows(x, params, pos, -1), _sample_rows(x, params, pos, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unfiltered_rows_draw_from_the_cdf_of_the_plain_softmax(dtype):
    # The CPU path's blocked in-place softmax and cumsum pick the ids the defining formula
    # (`_probs`: softmax(x / T) in float64, then its cumsum) picks, on a real vocabulary size.
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(40, 49152, generator=g) * 4).to(dtype)
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([1.0, 0.7, 1.3, 0.05] * 10)]
    pos = list(range(40))
    rows = _Rows.of(params, pos, x.shape[1], x.device)
    cdf = _probs(x, rows).cumsum(dim=-1)
    want = torch.searchsorted(cdf, rows.u * cdf[:, -1:], right=True).squeeze(1)
    assert torch.equal(_sample_rows(x, params, pos, -1), want)


def test_the_reused_buffers_serve_calls_in_and_out_of_inference_mode():
    # One thread samples inside inference mode (a torch engine's step) and outside it (vLLM's
    # logits processor): the buffers kept between calls must be writable in both.
    x = torch.randn(4, 5000, generator=torch.Generator().manual_seed(1))
    for p in ([SamplingParams(temperature=0.8, seed=i) for i in range(4)],
              [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(4)]):
        with torch.inference_mode():
            inside = sample_ids(x, p, [3] * 4)
        assert torch.equal(sample_ids(x, p, [3] * 4), inside)


ROW = [2.0, 1.5, 1.0, 0.2, -0.5, -3.0]
SETTINGS = {
    "plain": SamplingParams(temperature=1.0),
    "temp0.6-top_k4": SamplingParams(temperature=0.6, top_k=4),
    "temp1.3-top_p0.8": SamplingParams(temperature=1.3, top_p=0.8),
    "min_p0.2": SamplingParams(temperature=1.0, min_p=0.2),
    "all": SamplingParams(temperature=0.9, top_k=5, top_p=0.95, min_p=0.05),
}
# The counts the fixed seeds 0..3999 (position 7) give: deterministic, pinned.
PINNED = {
    "plain": [1777, 1082, 689, 293, 149, 10],
    "temp0.6-top_k4": [2345, 1069, 468, 118, 0, 0],
    "temp1.3-top_p0.8": [1836, 1275, 889, 0, 0, 0],
    "min_p0.2": [1991, 1250, 759, 0, 0, 0],
    "all": [1931, 1123, 679, 267, 0, 0],
}


def filtered(row: list[float], p: SamplingParams) -> list[float]:
    """The distribution the filters define, in plain Python."""
    w = [math.exp(x / p.temperature) for x in row]
    probs = [v / sum(w) for v in w]
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))
    keep = p.top_k or len(row)
    cum = 0.0
    for j, i in enumerate(order):
        cum += probs[i]
        if cum >= p.top_p:
            keep = min(keep, j + 1)
            break
    keep = min(keep, sum(1 for q in probs if q >= p.min_p * max(probs)))
    kept = order[:keep]
    mass = sum(probs[i] for i in kept)
    return [probs[i] / mass if i in kept else 0.0 for i in range(len(row))]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_distribution_chi_square_with_pinned_counts(name):
    base, n = SETTINGS[name], 4000
    params = [SamplingParams(temperature=base.temperature, top_k=base.top_k, top_p=base.top_p, min_p=base.min_p,
                             seed=s) for s in range(n)]
    logits = torch.tensor([ROW] * n, dtype=torch.float32)
    ids = sample(logits, params, [7] * n)
    counts = [ids.count(i) for i in range(len(ROW))]
    expected = filtered(ROW, base)
    assert all(c == 0 for c, q in zip(counts, expected) if q == 0.0)   # filtered tokens never drawn
    chi2 = sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, expected) if q > 0)
    df = sum(q > 0 for q in expected) - 1
    assert chi2 < {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}[df]   # p = 0.001
    assert counts == PINNED[name]


# ---- the speculative prefix (CPU) -------------------------------------------------------------------
def front(x: torch.Tensor, rows: _Rows, drop: torch.Tensor):
    """What `_sample_speculative` hands its levels: the logits it compares (float32 or float64), step 1
    with the largest logits, a level's cut `drop` [R] below them and the indices at or above it."""
    xs = x if x.dtype == torch.float64 else x.float()
    xmax = xs.amax(dim=-1).to(torch.float64)
    base = _cut_base(xmax)
    cut = (base + drop).to(xs.dtype)
    probs, flat = _blocked_probs(x, rows, xs, cut)
    return xs, _Softmax(probs, xmax, base), cut, flat


def levels(x: torch.Tensor, params: list[SamplingParams], cap: int) -> list[int]:
    """Which level of `_sample_speculative` serves each row: 1 the prefix down to p_max / 4096,
    2 the prefix down to the top-p histogram's floor, 3 the full sort (rows are independent: level 2
    is tried on every row here, on the level-1 misses there)."""
    vocab, cap = x.shape[1], min(cap, x.shape[1])
    rows = _Rows.of(params, [0] * len(params), vocab, x.device)
    top_p, min_p = any(q.top_p < 1.0 for q in params), any(q.min_p > 0.0 for q in params)
    xs, sm, cut, flat = front(x, rows, rows.drop)
    first = _prefix_draw(xs, sm, cut, flat, rows, top_p, min_p, cap, tighten=True)[1]
    pmax = sm.probs.amax(dim=-1)
    xs, sm, cut, flat = front(x, rows, rows.temp * torch.log(_second_floor(sm.probs, pmax, rows, min_p) / pmax))
    second = _prefix_draw(xs, sm, cut, flat, rows, top_p, min_p, cap)[1]
    return [1 if a else 2 if b and top_p else 3 for a, b in zip(first.tolist(), second.tolist())]


@pytest.mark.parametrize("vocab", [300, 70000])      # blocks of many rows; one row per block
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_blocked_probs_are_the_softmax_bit_for_bit(vocab, dtype):
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(13, vocab, generator=g) * 5).to(dtype)
    params = [SamplingParams(temperature=0.3 + 0.1 * i, top_p=0.9, seed=i) for i in range(13)]
    rows = _Rows.of(params, [0] * 13, vocab, x.device)
    probs, flat = _blocked_probs(x, rows)
    assert torch.equal(probs, _probs(x, rows)) and flat is None
    # With a cut, the indices at or above it, marked block by block: `_at_least`'s.
    xs = x if x.dtype == torch.float64 else x.float()
    cut = xs.amax(dim=-1) - torch.arange(13) * 0.5 + torch.arange(13).remainder(2) * 100.0
    probs, flat = _blocked_probs(x, rows, xs, cut)
    assert torch.equal(probs, _probs(x, rows)) and torch.equal(flat, _at_least(xs, cut[:, None]))
    assert torch.equal(flat, (xs >= cut[:, None]).view(-1).nonzero().squeeze(1)) and flat.shape[0] > 13


def test_second_floor_is_a_bucket_floor_under_the_top_p_set():
    # p = 1/2, 1/4, 1/8, ... (exact powers of two: each its own bucket, floor = p itself).
    x = torch.log(torch.tensor([[2.0 ** -k for k in range(1, 40)]], dtype=torch.float64)).repeat(4, 1)
    params = [SamplingParams(temperature=1.0, top_p=q, min_p=m, seed=0)
              for q, m in ((0.7, 0.0), (0.9, 0.0), (1.0, 0.0), (0.9, 0.3))]
    rows = _Rows.of(params, [0] * 4, x.shape[1], x.device)
    probs = _blocked_probs(x, rows)[0]
    pmax = probs.amax(dim=-1)
    floor = _second_floor(probs, pmax, rows, True).tolist()
    # 0.7 needs 1/2 + 1/4; 0.9 needs down to 1/16; top_p 1: no bound; min-p 0.3: p >= 0.3 * p_max.
    assert floor[:3] == pytest.approx([0.25, 0.0625, 0.0], rel=1e-12) and floor[3] == pytest.approx(0.15)
    # Level 1 cuts T log(1 / 4096) below x_max for top-p, T log(min_p) for min-p (a 1e-6 margin).
    assert [_drop(p) for p in params] == pytest.approx([math.log(2.0 ** -12)] * 2 + [-math.inf, math.log(0.3)],
                                                       rel=2e-6)


def test_speculative_prefix_is_the_full_sorts_prefix():
    # Integer logits (ties everywhere, the cut falls inside a tie) and a peaked row: the n candidates
    # are the first n of the stable full sort (logit desc, id asc), their probabilities too.
    g = torch.Generator().manual_seed(8)
    x = torch.randint(-8, 8, (6, 2000), generator=g).to(torch.float32) * 0.75
    x[5, 100:110] = 20.0
    params = [SamplingParams(temperature=t, top_p=q, min_p=m, seed=1)
              for t, q, m in ((1.0, 0.9, 0.0), (0.3, 0.5, 0.0), (0.8, 1.0, 0.2), (2.0, 0.3, 0.05),
                              (0.1, 0.95, 0.0), (0.8, 0.95, 0.0))]
    rows = _Rows.of(params, [0] * 6, 2000, x.device)
    probs = _blocked_probs(x, rows)[0]
    pmax = probs.amax(dim=-1)
    floor = _second_floor(probs, pmax, rows, True)
    cand, cand_p, n = _prefix_candidates(*front(x, rows, rows.temp * torch.log(floor / pmax)), rows, 2000)
    order = x.sort(dim=-1, descending=True, stable=True).indices
    for r in range(6):
        k = int(n[r])
        assert 0 < k < 2000
        assert torch.equal(cand[r, :k], order[r, :k]) and torch.equal(cand_p[r, :k], probs[r, order[r, :k]])
        assert x[r, order[r, k]] < x[r, order[r, k - 1]]     # ties at the cut are all in
        assert not cand_p[r, k:].any()                         # padding: the cdf stays flat
        assert (probs[r, order[r, k:]] < floor[r]).all()       # every p >= floor is in
    assert n.tolist()[5] == 10                                  # the ten tokens at 20.0 hold it all


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_speculative_path_equals_the_full_sort_path(dtype):
    # Peaked, spread, flat and tied rows, -inf masks; every filter mix of the full-sort mode.  Each
    # level serves some rows at cap 1024, cap 4 sends most to the full sort: all equal the full sort.
    g = torch.Generator().manual_seed(9)
    r, vocab = 48, 5000
    x = torch.randn(r, vocab, generator=g) * torch.tensor([0.01, 1.0, 4.0, 12.0]).repeat(12)[:, None]
    x[::5, :40] += 15.0
    x[3::7] = torch.randint(-3, 3, (len(range(3, r, 7)), vocab), generator=g).float()
    x[1::9, 2000:] = float("-inf")
    x[18], x[18, 0], x[18, 1:1001] = -40.0, 9.0, 0.0     # top_p 0.999 needs the 1000 tokens at p_max / 8100
    x = x.to(dtype)
    params = [SamplingParams(temperature=(0.05, 0.8, 1.0, 2.0)[i % 4], top_p=(0.95, 0.5, 1.0, 0.999, 0.01)[i % 5],
                             min_p=(0.0, 0.0, 0.1)[i % 3], top_k=(0, vocab // 2)[i % 2], seed=1000 + i)
              for i in range(r)]
    params = [p if p.top_p < 1.0 or p.min_p > 0.0 else SamplingParams(temperature=p.temperature, top_p=0.9,
                                                                        seed=p.seed) for p in params]
    pos = list(range(r))
    full = _sample_rows(x, params, pos, 0)
    for cap in (1024, 4):
        served = levels(x, params, cap)
        if cap == 1024:
            assert {1, 2, 3} <= set(served) and served.count(1) > r // 2, served
        else:
            assert 0 < served.count(3) and served.count(3) > r // 2, served
        assert torch.equal(_sample_speculative(x, params, pos, cap), full), cap


def test_each_level_serves_its_rows_exactly():
    # Row 0: one token holds ~all the mass (level 1).  Row 1: 1000 equal logits (p ~ 1e-3 each), top_p
    # 0.4995 keeps 500 of them: level 1 (cap 1024), over the cap at 256: the full sort.  Row 2: a top
    # token and 200 at 9 below (p_max / 8100, under level 1's p_max / 4096 floor): top_p 0.98 needs
    # ~35 of them, level 2.
    x = torch.full((3, 4000), -40.0)
    x[0, 7] = 30.0
    x[1, :1000] = 10.0
    x[2, 0], x[2, 1:201] = 9.0, 0.0
    params = [SamplingParams(temperature=1.0, top_p=q, seed=s) for q, s in ((0.4995, 3), (0.4995, 4), (0.98, 5))]
    assert levels(x, params, 1024) == [1, 1, 2]
    assert levels(x, params, 256) == [1, 3, 2]
    for pos in range(40):
        full = _sample_rows(x, params, [pos] * 3, 0)
        for cap in (1024, 256, 1):
            assert torch.equal(_sample_speculative(x, params, [pos] * 3, cap), full)
        assert full[0] == 7 and 0 <= full[1] < 500 and 0 <= full[2] <= 200


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_degenerate_rows_reach_the_full_sort_unharmed(dtype):
    # A NaN, an all -inf row, a +inf: no prefix holds them (NaN cuts select nothing, NaN p fall in
    # no histogram bucket), so level 3 gives what the full sort always gave, without raising.
    x = torch.randn(4, 3000, generator=torch.Generator().manual_seed(12)) * 3
    x[0, 10], x[1], x[2, 5] = float("nan"), float("-inf"), float("inf")
    x = x.to(dtype)
    params = [SamplingParams(temperature=0.8, top_p=0.9, min_p=0.01 * (i % 2), seed=i) for i in range(4)]
    assert levels(x, params, 1024) == [3, 3, 3, 1]
    assert torch.equal(_sample_speculative(x, params, [0, 1, 2, 3]), _sample_rows(x, params, [0, 1, 2, 3], 0))
    # Only degenerate rows: no candidate at all.
    assert torch.equal(_sample_speculative(x[:3], params[:3], [0, 1, 2]), _sample_rows(x[:3], params[:3], [0, 1, 2], 0))


def test_sample_takes_the_speculative_path_on_the_cpu_for_top_p_and_min_p_rows(monkeypatch):
    calls = []
    real = sampler_mod._sample_speculative

    def spy(x, params, positions, cap=0):
        calls.append(len(params))
        return real(x, params, positions, cap)

    monkeypatch.setattr(sampler_mod, "_sample_speculative", spy)
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(8, 3000, generator=g) * 4
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=1),
              SamplingParams(temperature=1.0, top_k=20, seed=2), SamplingParams(temperature=0.7, min_p=0.1, seed=3),
              SamplingParams(temperature=0.9, seed=4), SamplingParams(temperature=0.9, top_k=2000, seed=5),
              SamplingParams(temperature=0.6, top_k=1000, top_p=0.9, seed=6),
              SamplingParams(temperature=1.2, top_p=0.99, min_p=0.01, seed=7)]
    got = sample(logits, params, list(range(8)))
    assert calls == [5]                      # the full-sort rows: 1, 3, 5, 6, 7, in one group
    full_rows = [1, 3, 5, 6, 7]
    ref = _sample_rows(logits[full_rows], [params[i] for i in full_rows], full_rows, 0)
    assert [got[i] for i in full_rows] == ref.tolist()
    assert got == [sample_one(logits[i], params[i], i) for i in range(8)]
    calls.clear()
    sample(logits[[5]], [params[5]], [5])    # top-k 2000 alone bounds nothing cheaply: the full sort
    assert calls == []


# ---- batch independence -----------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [1000, 40000])
def test_a_row_samples_the_same_alone_and_in_any_batch(vocab):
    g = torch.Generator().manual_seed(4)
    row = torch.randn(vocab, generator=g) * 3
    mine = [SamplingParams(temperature=0.8, top_p=0.95, seed=99),
            SamplingParams(temperature=1.1, top_k=50, seed=98),
            SamplingParams(temperature=0.7, min_p=0.05, top_p=0.9, seed=97)]
    others = [SamplingParams(), SamplingParams(temperature=1.0, seed=5),
              SamplingParams(temperature=0.5, top_k=7, seed=6),
              SamplingParams(temperature=0.9, top_k=300, top_p=0.5, seed=7)]
    positions = range(200) if vocab == 1000 else range(0, 200, 25)
    for pos in positions:
        p = mine[pos % len(mine)]
        alone = sample_one(row, p, pos)
        batch = torch.randn(32, vocab, generator=g) * 3
        at = pos % 32
        batch[at] = row
        params = [others[(i + pos) % len(others)] for i in range(32)]
        params[at] = p
        poss = [int(v) for v in torch.randint(0, 1000, (32,), generator=g)]
        poss[at] = pos
        assert sample(batch, params, poss)[at] == alone, pos


def test_sampling_is_independent_of_batch_order():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g, dtype=torch.float64)
    params = [SamplingParams(temperature=1.0, seed=11)] * 5
    batched = sample(logits, params, [0, 1, 2, 3, 4])
    alone = [sample_one(logits[i], params[i], i) for i in range(5)]
    reordered = sample(logits.flip(0), params, [4, 3, 2, 1, 0])[::-1]
    assert batched == alone == reordered


# ---- what crosses to the host -----------------------------------------------------------------------
class HostTransfers(TorchFunctionMode):
    """Records every tensor -> Python / host read made during a call."""

    READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "__len__",
             "__iter__", "__array__", "__format__", "__repr__"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        to_cpu = name == "to" and any(str(a) == "cpu" for a in [*args[1:], *(kwargs or {}).values()])
        if name in self.READS or to_cpu:
            t = args[0]
            self.reads.append((name, t.dtype, tuple(t.shape)))
        return func(*args, **(kwargs or {}))


def test_only_the_sampled_ids_cross_to_the_host():
    g = torch.Generator().manual_seed(5)
    s, vocab = 12, 3000
    logits = torch.randn(s, vocab, generator=g)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=1),
              SamplingParams(temperature=1.0, top_k=20, seed=2), SamplingParams(temperature=0.7, min_p=0.1, seed=3)] * 3
    with HostTransfers() as rec:
        ids = sample(logits, params, list(range(s)))
    assert rec.reads == [("tolist", torch.int64, (s,))]               # S * 8 bytes, once per step
    assert len(ids) == s
    with HostTransfers() as rec:
        sample_ids(logits, params, list(range(s)))
    assert rec.reads == []


# ---- log-probabilities ------------------------------------------------------------------------------
def test_logprobs_on_device_are_small_tensors():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams()]
    with HostTransfers() as rec:
        ids = sample_ids(logits, params, [0, 0])
        chosen, top_ids, top_lp = logprobs(logits, ids, top_n=2)
    assert rec.reads == []
    assert chosen.dtype == top_lp.dtype == torch.float32 and top_ids.dtype == torch.int64
    assert top_ids.tolist() == [[1, 2], [2, 3]]
    for r, row in enumerate(logits.tolist()):
        lse = math.log(sum(math.exp(v) for v in row))
        assert chosen[r].item() == pytest.approx(row[ids[r].item()] - lse, abs=1e-6)
        assert top_lp[r].tolist() == pytest.approx([row[i] - lse for i in top_ids[r].tolist()], abs=1e-6)
    assert logprobs(logits, ids)[1].shape == (2, 0)


# ---- penalties, logit_bias, min_tokens (`adjust_logits`), against hand computations -------------------------

from pddgw.engines.penalties import TokenHistory, adjust_logits  # noqa: E402

PEN_ROW = [0.5, -1.0, 2.0, 0.0, 3.0, -2.0]            # float64: every step below is exact
INF = float("-inf")


def adjusted(params: SamplingParams, tokens=(), num_prompt: int = 0, eos=(3,)) -> list[float]:
    x = torch.tensor([PEN_ROW], dtype=torch.float64)
    out = adjust_logits(x, [params], [len(tokens) - num_prompt], [TokenHistory(list(tokens), num_prompt)], eos)
    assert x.tolist() == [PEN_ROW]                     # the raw logits are left as they are (logprobs use them)
    return out[0].tolist()


def test_logit_bias_is_added():
    assert adjusted(SamplingParams(logit_bias={"1": 2.5, 4: -1.5})) == [0.5, 1.5, 2.0, 0.0, 1.5, -2.0]
    # Greedy takes the biased argmax: 4 (3.0) drops to 1.5, 2 (2.0) wins.
    x = torch.tensor([PEN_ROW], dtype=torch.float64)
    sp = SamplingParams(logit_bias={4: -1.5})
    assert sample(adjust_logits(x, [sp], [0], [TokenHistory([0], 1)]), [sp], [0]) == [2]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output_tokens():
    # prompt (0, 1), output (2,): 0.5 / 2, -1 * 2, 2 / 2; 3..5 never seen.
    assert adjusted(SamplingParams(repetition_penalty=2.0), (0, 1, 2), 2) == [0.25, -2.0, 1.0, 0.0, 3.0, -2.0]
    assert adjusted(SamplingParams(repetition_penalty=0.5), (5,), 0) == [0.5, -1.0, 2.0, 0.0, 3.0, -1.0]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    # prompt (0,), output (2, 2, 5): x[2] -= 0.25 * 2 + 0.5, x[5] -= 0.25 * 1 + 0.5; x[0] (prompt only) unchanged.
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    assert adjusted(sp, (0, 2, 2, 5), 1) == [0.5, -1.0, 1.0, 0.0, 3.0, -2.75]
    # Negative penalties reward repeats.
    assert adjusted(SamplingParams(presence_penalty=-1.0), (0, 4), 1) == [0.5, -1.0, 2.0, 0.0, 4.0, -2.0]
    # The same tokens as prompt: nothing.
    assert adjusted(sp, (0, 2, 2, 5), 4) == PEN_ROW


def test_min_tokens_masks_eos_and_stop_tokens_until_that_many_outputs():
    sp = SamplingParams(min_tokens=2, stop_token_ids=(5,))
    assert adjusted(sp, (0, 1), 1) == [0.5, -1.0, 2.0, INF, 3.0, INF]        # 1 output: EOS 3 and stop 5 masked
    assert adjusted(sp, (0, 1, 2), 1) == PEN_ROW                                 # 2 outputs: free
    assert adjusted(SamplingParams(min_tokens=2, stop_token_ids=(5,), ignore_eos=True), (0,), 1) == [
        0.5, -1.0, 2.0, 0.0, 3.0, INF]
    assert adjusted(SamplingParams(min_tokens=1), (0,), 1, eos=(3, 99)) == [0.5, -1.0, 2.0, INF, 3.0, -2.0]


def test_order_is_vllms_bias_then_penalties():
    # x[1] = -1 + 2 (bias) = 1, seen: / 2 (repetition) = 0.5, then - 0.5 (presence) = 0; x[4] = 3 - 1 = 2.
    sp = SamplingParams(logit_bias={1: 2.0, 4: -1.0}, repetition_penalty=2.0, presence_penalty=0.5)
    assert adjusted(sp, (0, 1), 1) == [0.25, 0.0, 2.0, 0.0, 2.0, -2.0]


def test_adjusting_touches_only_the_rows_that_ask_and_a_batch_equals_its_rows_alone():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 50, generator=g, dtype=torch.float64)
    plain = [SamplingParams(temperature=0.8, seed=i) for i in range(8)]
    hist = [TokenHistory([int(t) for t in torch.randint(0, 50, (12,), generator=g)], 5) for _ in range(8)]
    pos = [7] * 8
    assert adjust_logits(x, plain, pos, hist, (3,)) is x                      # nobody asks: not even a copy
    asks = {1: SamplingParams(repetition_penalty=1.3), 4: SamplingParams(frequency_penalty=0.7, logit_bias={9: 3}),
            6: SamplingParams(min_tokens=9, presence_penalty=-0.2)}
    params = [asks.get(i, p) for i, p in enumerate(plain)]
    out = adjust_logits(x, params, pos, hist, (3,))
    for i in range(8):
        alone = adjust_logits(x[i:i + 1], [params[i]], [7], [hist[i]], (3,))[0]
        assert torch.equal(out[i], alone) and torch.equal(out[i], x[i]) == (i not in asks), i


def test_sampling_params_refuse_out_of_range_values_naming_the_field():
    from pddgw.core.errors import FieldError

    for kw, field in [({"repetition_penalty": 0.0}, "repetition_penalty"),
                      ({"presence_penalty": 2.1}, "presence_penalty"),
                      ({"frequency_penalty": -2.1}, "frequency_penalty"), ({"logit_bias": {1: 100.5}}, "logit_bias"),
                      ({"logit_bias": {-1: 1}}, "logit_bias"), ({"min_tokens": 65}, "min_tokens"),
                      ({"min_tokens": -1}, "min_tokens"), ({"temperature": 2.01}, "temperature")]:
        with pytest.raises(FieldError) as ei:
            SamplingParams(**kw)
        assert ei.value.field == field and str(ei.value).startswith(field), kw
    with pytest.raises(FieldError, match="logit_bias must be keyed by token ids of the vocabulary"):
        SamplingParams(logit_bias={50: 1}).check_vocab(50)


def test_engine_honours_min_tokens_and_logit_bias_and_refuses_bias_outside_the_vocabulary(tiny64):
    from pddgw.engines.types import EngineRequest
    from tests.engines.conftest import make_engine

    eos = min(tiny64.spec.eos_token_ids)
    eng = make_engine(tiny64)
    # EOS pushed to the top: masked for 3 outputs, then drawn at position 3, which ends the request.
    eng.add_request(EngineRequest("m", (5, 6, 7, 8), SamplingParams(max_tokens=10, min_tokens=3,
                                                                     logit_bias={eos: 100.0})))
    outs = []
    while eng.has_work():
        outs += eng.step()
    tokens = [t for o in outs for t in o.ids]
    assert len(tokens) == 4 and eos not in tokens[:3] and tokens[3] == eos
    assert (outs[-1].done, outs[-1].reason) == (True, "stop")
    with pytest.raises(RequestError, match="logit_bias"):
        eng.add_request(EngineRequest("v", (5,), SamplingParams(logit_bias={tiny64.spec.vocab_size: 1.0})))
    assert "v" not in eng.seqs
