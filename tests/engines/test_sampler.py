"""Position-keyed sampling: same (seed, position, logits) -> same token, anywhere."""

import torch

from pddgw.engines.sampler import position_uniform, sample, sample_one
from pddgw.engines.types import SamplingParams


def test_position_uniform_depends_only_on_seed_and_position():
    assert position_uniform(7, 3) == position_uniform(7, 3)
    draws = {position_uniform(7, i) for i in range(100)}
    assert len(draws) == 100 and all(0.0 <= u < 1.0 for u in draws)
    assert position_uniform(7, 3) != position_uniform(8, 3)


def test_greedy_picks_first_max():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits, [SamplingParams(), SamplingParams()], [0, 0]) == [1, 0]


def test_sampling_is_independent_of_batch_composition():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g, dtype=torch.float64)
    params = [SamplingParams(temperature=1.0, seed=11)] * 5
    batched = sample(logits, params, [0, 1, 2, 3, 4])
    alone = [sample_one(logits[i], params[i], i) for i in range(5)]
    reordered = sample(logits.flip(0), params, [4, 3, 2, 1, 0])[::-1]
    assert batched == alone == reordered


def test_inverse_cdf_matches_the_uniform():
    # Three tokens with probabilities 0.5, 0.3, 0.2 (sorted order 0, 1, 2).
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))
    p = SamplingParams(temperature=1.0, seed=5)
    for pos in range(30):
        u = position_uniform(5, pos)
        expected = 0 if u < 0.5 else 1 if u < 0.8 else 2
        assert sample_one(logits, p, pos) == expected


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.1, 0.5, 0.15, 0.25], dtype=torch.float64))
    top1 = SamplingParams(temperature=1.0, top_k=1, seed=1)
    assert {sample_one(logits, top1, i) for i in range(20)} == {1}
    # top_p 0.7: sorted 0.5 (id 1), 0.25 (id 3) reach 0.75 >= 0.7; ids 0 and 2 never drawn.
    nucleus = SamplingParams(temperature=1.0, top_p=0.7, seed=1)
    assert {sample_one(logits, nucleus, i) for i in range(200)} == {1, 3}
    top2 = SamplingParams(temperature=1.0, top_k=2, seed=1)
    assert {sample_one(logits, top2, i) for i in range(200)} == {1, 3}


def test_distribution_follows_probabilities():
    logits = torch.log(torch.tensor([0.7, 0.3], dtype=torch.float64))
    p = SamplingParams(temperature=1.0, seed=3)
    picks = [sample_one(logits, p, i) for i in range(2000)]
    assert 0.65 < picks.count(0) / 2000 < 0.75
