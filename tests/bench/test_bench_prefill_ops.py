"""pddgw.bench.prefill_ops: its rows on a tiny shape (a stub timer), which outputs share their bits,
and the table and JSON of `main`."""

from __future__ import annotations

import json

import pytest

from pddgw.bench import prefill_ops as B
from pddgw.kernels import cpu_ops, cpu_pointwise

needs_kernels = pytest.mark.skipif(not cpu_pointwise.available() or cpu_ops._load_prompt() is None,
                                   reason="no AVX-512 BF16 / AMX (or no C compiler) here")


@needs_kernels
def test_main_prints_the_table_and_json(monkeypatch, capsys):
    monkeypatch.setattr(B, "SHAPES", (("tiny", 64, 4, 2, 32, 96),))
    monkeypatch.setattr(B, "PROMPTS", ((2, 40),))
    timed = []

    def stub(fn, other, calls):
        timed.append(calls)
        return 1.0, 4.0

    monkeypatch.setattr(B, "alternating_medians_us", stub)
    assert B.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("bfloat16 prefill passes, C vs torch")
    assert "80 x 64" in out and "80 x 6 x 32" in out and "80 x 2 x 96" in out and "2 x 40" in out
    assert timed == [10, 10, 10, 10]
    assert B.main(["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["op"], r["speedup"], r["same_bits"]) for r in rows] == [
        ("rms_norm", 4.0, True), ("rope", 4.0, True), ("silu x up", 4.0, True), ("prompt attention", 4.0, False)]
    assert rows[0]["c_err"] is None
    # Attention: both sides within bfloat16's rounding of the float64 result.
    assert 0 < rows[3]["c_err"] < 0.05 and 0 < rows[3]["torch_err"] < 0.05
