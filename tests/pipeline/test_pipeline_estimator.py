"""Link estimator: prior, EWMA convergence, robustness to a few outliers, level shifts."""

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


@pytest.mark.parametrize("n", [1, 2, 4])
def test_bandwidth_convergence_closed_form(n: int):
    e = est(prior_bandwidth_bytes_per_s=2.4e8)      # samples within 25 %: no level shift
    for _ in range(n):
        assert e.observe_transfer(2_000_000, 0.01)      # 2e8 B/s
    expected = 2e8 + 0.8 ** n * (2.4e8 - 2e8)
    assert e.estimate().bandwidth_bytes_per_s == pytest.approx(expected, rel=1e-12)
    assert e.estimate().bandwidth_samples == n


def test_rtt_convergence_closed_form():
    e = est(prior_rtt_ms=70.0)
    for _ in range(25):
        e.observe_rtt(80.0)
    assert e.estimate().rtt_ms == pytest.approx(80.0 + 0.8 ** 25 * (70.0 - 80.0), rel=1e-12)
    assert e.estimate().rtt_samples == 25


def test_a_wrong_prior_is_replaced_after_one_window():
    e = est()                                        # prior 1e9 B/s, the link does 2e8
    for i in range(5):
        e.observe_transfer(2_000_000, 0.01)
        if i < 4:
            assert e.estimate().bandwidth_bytes_per_s == pytest.approx(2e8 + 0.8 ** (i + 1) * 8e8)
    assert e.estimate().bandwidth_bytes_per_s == 2e8


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


def test_level_shift_is_followed_within_a_window():
    e = est(prior_bandwidth_bytes_per_s=2e8)
    for _ in range(5):
        e.observe_transfer(2_000_000, 0.01)
    # The link degrades to 5e7: two samples are absorbed, the third moves the
    # median, the fifth fills the window with the new level: the estimate jumps.
    vals = []
    for _ in range(5):
        e.observe_transfer(2_000_000, 0.04)
        vals.append(e.estimate().bandwidth_bytes_per_s)
    assert vals[:2] == [2e8, 2e8]
    assert vals[2] == pytest.approx(2e8 + 0.2 * (5e7 - 2e8))
    assert vals[4] == 5e7
    # ...and back up (x4) the same way.
    for _ in range(5):
        e.observe_transfer(2_000_000, 0.01)
    assert e.estimate().bandwidth_bytes_per_s == 2e8


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


def test_the_estimate_follows_a_shaped_links_bandwidth_steps():
    """KV transfers over a link shaped by a step trace (8 -> 2 -> 8 Gbps), fed to
    the estimator as P reports them (bytes, seconds on the wire): it tracks each
    step within three transfers (one median window), on the virtual clock."""
    import asyncio

    from pddgw.config import NetConfig, ShapingConfig
    from pddgw import messages as m
    from pddgw.net.inproc import InProcNetwork, wire_size
    from pddgw.sim.clock import run_virtual

    shape = ShapingConfig(name="wan", latency_ms=15.0, trace=((0.0, 8.0), (1.0, 2.0), (2.0, 8.0)))
    span = m.KVSpan("r", 0, 1, 0, 500, "bfloat16", (1, 2, 500, 8, 1000), virtual=True)   # 16 MB of KV
    frame = m.KVChunk(span, b"")
    nbytes = wire_size(frame)

    async def main() -> list[tuple[float, float]]:
        net = InProcNetwork(NetConfig(links=(shape,)))
        net.listen("md")
        link = await net.connect("p", "md", shaping="wan")
        e = LinkEstimator.from_config(PolicyConfig(link_prior_mbps=8000.0))
        loop = asyncio.get_running_loop()
        seen = []
        while loop.time() < 3.0:
            start = loop.time()
            service = await link.send_all([frame] * 4)            # one transfer: 4 frames
            e.observe_transfer(4 * nbytes, service)
            seen.append((start, e.estimate().bandwidth_bytes_per_s * 8 / 1e9))
            await asyncio.sleep(0.05)
        await net.close()
        return seen

    seen = run_virtual(main())

    def after(step: float) -> list[float]:
        """The estimate after each transfer that started after the step."""
        return [round(g, 6) for t, g in seen if t > step]

    assert all(round(g, 6) == 8.0 for t, g in seen if t < 1.0)
    assert after(1.0)[:3] == [8.0, 6.8, 2.0]                       # 2 Gbps from the third transfer on
    assert set(after(1.0)[2:4]) == {2.0}
    # Up again: the first transfer straddles the step (its mean rate is in between).
    assert after(2.0)[1:] == [8.0] * (len(after(2.0)) - 1)
