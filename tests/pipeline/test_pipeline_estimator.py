"""Link estimator: prior, EWMA convergence, robustness to a few outliers."""

from __future__ import annotations

import pytest

from pddgw.config import PolicyConfig
from pddgw.pipeline.estimator import LinkEstimate, LinkEstimator, RobustEwma


def est(**kw) -> LinkEstimator:
    base = dict(prior_bandwidth_bytes_per_s=1e9, prior_rtt_ms=30.0, alpha=0.2, window=5,
                min_sample_bytes=1000)
    base.update(kw)
    return LinkEstimator(**base)


def test_prior_from_config():
    e = LinkEstimator.from_config(PolicyConfig(link_prior_mbps=800.0, link_prior_rtt_ms=12.0))
    assert e.estimate() == LinkEstimate(1e8, 12.0, 0, 0)
    assert e.estimate().transfer_ms(1_000_000) == 6.0 + 10.0


def test_plain_ewma_with_window_one():
    r = RobustEwma(100.0, 0.5, 1)
    assert [r.update(x) for x in (0.0, 0.0, 200.0)] == [50.0, 25.0, 112.5]
    assert r.samples == 3


@pytest.mark.parametrize("n", [1, 3, 10, 40])
def test_bandwidth_convergence_closed_form(n: int):
    e = est()
    for _ in range(n):
        assert e.observe_transfer(2_000_000, 0.01)      # 2e8 B/s
    expected = 2e8 + 0.8 ** n * (1e9 - 2e8)
    assert e.estimate().bandwidth_bytes_per_s == pytest.approx(expected, rel=1e-12)
    assert e.estimate().bandwidth_samples == n


def test_rtt_convergence_closed_form():
    e = est()
    for _ in range(25):
        e.observe_rtt(80.0)
    assert e.estimate().rtt_ms == pytest.approx(80.0 + 0.8 ** 25 * (30.0 - 80.0), rel=1e-12)
    assert e.estimate().rtt_samples == 25


def test_isolated_outliers_do_not_move_the_estimate():
    e = est(prior_bandwidth_bytes_per_s=2e8)
    for _ in range(5):
        e.observe_transfer(2_000_000, 0.01)
    assert e.estimate().bandwidth_bytes_per_s == 2e8
    # Two outliers inside a window of five: the median is still 2e8.
    e.observe_transfer(2_000_000, 1.0)      # 100x slow
    e.observe_transfer(2_000_000, 0.0001)   # 100x fast
    assert e.estimate().bandwidth_bytes_per_s == 2e8
    e.observe_transfer(2_000_000, 0.01)
    assert e.estimate().bandwidth_bytes_per_s == 2e8


def test_level_shift_is_followed():
    e = est(prior_bandwidth_bytes_per_s=2e8)
    for _ in range(5):
        e.observe_transfer(2_000_000, 0.01)
    # The link degrades to 5e7: two samples are absorbed, the third moves the median.
    vals = []
    for _ in range(3):
        e.observe_transfer(2_000_000, 0.04)
        vals.append(e.estimate().bandwidth_bytes_per_s)
    assert vals[:2] == [2e8, 2e8]
    assert vals[2] == pytest.approx(2e8 + 0.2 * (5e7 - 2e8))
    for _ in range(60):
        e.observe_transfer(2_000_000, 0.04)
    assert e.estimate().bandwidth_bytes_per_s == pytest.approx(5e7, rel=1e-5)


def test_rtt_outliers_absorbed():
    e = est(prior_rtt_ms=20.0)
    for x in (20.0, 20.0, 20.0, 500.0, 20.0, 0.0, 20.0):
        e.observe_rtt(x)
    assert e.estimate().rtt_ms == 20.0


def test_small_and_zero_time_transfers_are_ignored():
    e = est()
    assert not e.observe_transfer(999, 0.001)
    assert not e.observe_transfer(5000, 0.0)
    assert e.observe_transfer(1000, 0.001)
    assert e.estimate().bandwidth_samples == 1
    assert e.estimate().bandwidth_bytes_per_s == pytest.approx(1e9 + 0.2 * (1e6 - 1e9))
    with pytest.raises(ValueError):
        e.observe_transfer(-1, 1.0)
    with pytest.raises(ValueError):
        e.observe_rtt(-1.0)
    with pytest.raises(ValueError):
        est(prior_bandwidth_bytes_per_s=0)
    with pytest.raises(ValueError):
        RobustEwma(1.0, 0.0, 3)
