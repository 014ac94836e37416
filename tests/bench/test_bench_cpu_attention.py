"""pddgw.bench.cpu_attention: its arithmetic on a tiny pool (a stub timer), the sides' alternation,
the pool's size bound, and the table and JSON of `main`."""

from __future__ import annotations

import json

import pytest
import torch

from pddgw import tables
from pddgw.bench import cpu_attention as B


def test_a_point_reports_bandwidth_speedup_and_both_errors(monkeypatch):
    calls = []

    def timed(fn, other, n):
        calls.append((fn().shape, other().shape, n))
        return 2.0, 5.0

    monkeypatch.setattr(B, "alternating_medians_us", timed)
    p = B.point("tiny", 4, 2, 32, batch=3, context=40, dtype=torch.float32, layers=4, block_size=16, calls=7)
    assert calls == [((3, 4, 32), (3, 4, 32), 7)]
    assert (p.kernel_us, p.reference_us, p.speedup) == (2.0, 5.0, 2.5)
    # K and V of 3 sequences x 40 tokens x 2 KV heads x 32 dims, float32, in 2 us.
    assert p.kernel_gbps == pytest.approx(2 * 3 * 40 * 2 * 32 * 4 / 2.0 / 1e3)
    assert 0 < p.kernel_err < 1e-5 and 0 < p.reference_err < 1e-5


def test_the_sides_alternate_and_each_keeps_its_median(monkeypatch):
    order = []
    # Start and end of a, b, a, b, a, b: a takes 1, 5 and 3 s, b 2, 2 and 9 s.
    clock = iter([0, 1, 1, 3, 3, 8, 8, 10, 10, 13, 13, 22])
    monkeypatch.setattr(tables.time, "perf_counter", lambda: next(clock))
    a, b = tables.alternating_medians_us(lambda: order.append("a"), lambda: order.append("b"), 3)
    assert order == ["a", "b"] * 3
    assert (a, b) == (3e6, 2e6)


def test_the_pool_is_bounded(monkeypatch):
    made = []
    real = B.KVPool

    def pool(layers, *args, **kw):
        made.append(layers)
        return real(layers, *args, **kw)

    monkeypatch.setattr(B, "KVPool", pool)
    monkeypatch.setattr(B, "_POOL_BYTES", 2 * 2 * 48 * 2 * 32 * 4 * 3)     # three layers' worth
    monkeypatch.setattr(B, "alternating_medians_us", lambda fn, other, n: (1.0, 1.0))
    B.point("tiny", 4, 2, 32, batch=2, context=48, dtype=torch.float32, layers=30, block_size=16, calls=1)
    assert made == [3]


def test_main_prints_the_table_and_json(monkeypatch, capsys):
    monkeypatch.setattr(B, "SHAPES", (("tiny", 4, 2, 32),))
    monkeypatch.setattr(B, "alternating_medians_us", lambda fn, other, n: (1.0, 3.0))
    assert B.main(["--quick", "--dtype", "bfloat16", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("decode attention, one layer  bfloat16")
    assert "tiny" in out and "1 x 320" in out and "16 x 320" in out
    assert B.main(["--quick", "--json", "--layers", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(p["batch"], p["context"], p["speedup"]) for p in report["points"]] == [(1, 320, 3.0), (16, 320, 3.0)]
