"""pddgw.bench.linear: a forward's GEMM list, the layer bound, a point's arithmetic (a stub timer),
and the table and JSON of `main`."""

from __future__ import annotations

import json

import pytest
import torch

from pddgw.bench import linear as B
from pddgw.kernels import cpu_linear

needs_amx = pytest.mark.skipif(not cpu_linear.available(), reason="no AMX-BF16 (or no C compiler) on this machine")


def test_a_forward_is_four_gemms_a_layer_then_the_lm_head():
    assert B.shapes(64, 128, 96, 2, 384) == [(128, 64), (64, 64), (192, 64), (64, 96)] * 2 + [(384, 64)]
    assert B.shapes(64, 128, 96, 1, 0) == [(128, 64), (64, 64), (192, 64), (64, 96)]


@needs_amx
def test_a_point_reports_speedup_bandwidth_and_equal_bits(monkeypatch):
    calls = []

    def timed(fn, other, n):
        calls.append((len(fn()), len(other()), n))
        return 4.0, 6.0

    monkeypatch.setattr(B, "alternating_medians_us", timed)
    # Layers of 2 * (128*64 + 64*64 + 192*64 + 64*96) = 61,440 bytes and a 49,152-byte lm_head:
    # 3 layers fit in 250,000 bytes beside it.
    pts = B.model_points("tiny", 64, 128, 96, 10, 384, rows=(1, 33), max_bytes=250_000, calls=5)
    assert calls == [(13, 13, 5)] * 2
    assert [(p.layers, p.rows, p.tiles_us, p.onednn_us, p.speedup) for p in pts] == \
        [(3, 1, 4.0, 6.0, 1.5), (3, 33, 4.0, 6.0, 1.5)]
    assert pts[0].tiles_gbps == pytest.approx((3 * 61_440 + 49_152) / 4.0 / 1e3)
    assert pts[0].same_bits


def test_main_prints_the_table_and_json(monkeypatch, capsys):
    monkeypatch.setattr(B, "MODELS", (("tiny", 64, 128, 96, 2, 384),))
    monkeypatch.setattr(B, "alternating_medians_us", lambda fn, other, n: (2.0, 3.0))
    if not cpu_linear.available():
        assert B.main(["--quick"]) == 0
        assert "not available here" in capsys.readouterr().out
        return
    assert B.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"bfloat16 linear layers, one forward's GEMMs  {torch.get_num_threads()} threads")
    assert "tiny" in out and "yes" in out
    assert B.main(["--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(p["rows"], p["speedup"], p["same_bits"]) for p in report["points"]] == [(1, 1.5, True), (16, 1.5, True)]


def test_main_says_when_there_is_no_kernel(monkeypatch, capsys):
    monkeypatch.setattr(B.cpu_linear, "available", lambda: False)
    assert B.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"skipped": "no AMX-BF16 kernel here"}
