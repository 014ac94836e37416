"""pddgw.bench.kernels: the no-GPU exit, and its arithmetic on a tiny CPU run
(Triton interpreter, SDPA on CPU, a stub timer of exactly 1 us per call)."""

from __future__ import annotations

import json

import pytest
import torch

from pddgw.bench import kernels as B


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("args", [["--quick"], ["--quick", "--json"]])
def test_without_gpu_says_so_and_exits_0(args, capsys):
    assert B.main(args) == 0
    out = capsys.readouterr().out
    text = json.loads(out)["skipped"] if "--json" in args else out
    assert "no CUDA device" in text


def test_tiny_run_on_cpu_reports_bandwidth_and_flops(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the GPU runs the real benchmark")
    monkeypatch.setattr(B, "_bench_us", lambda fn: (fn(), 1.0)[1])
    sizes = B.Sizes(batches=(2,), contexts=(40,), ks=(1, 3), prefixes=(20,))
    report = B.run(sizes=sizes, dtype_name="float32", q_heads=4, kv_heads=2, head_dim=64,
                   block_size=16, peak_tbps=4.8, device="cpu")
    assert report.peak_gbps == 4800.0
    (d,) = report.decode
    # K and V of 2 x 40 tokens x 2 heads x 64 dims, q and out, a 2 x 3 block table.
    moved = (2 * 2 * 40 * 2 * 64 + 2 * 2 * 4 * 64) * 4 + 2 * 3 * 4
    assert d.triton_gbps == pytest.approx(moved / 1e3)
    assert d.triton_peak_frac == pytest.approx(moved / 1e3 / 4800)
    assert d.speedup == 1.0
    assert d.max_err < 1e-5                        # the kernel agrees with SDPA
    e1, e3 = report.extend
    assert (e1.k, e3.k) == (1, 3)
    # queries see 21 keys (k=1), and 21 + 22 + 23 keys (k=3): 4 * H * D FLOPs per key.
    assert e1.triton_tflops == pytest.approx(4 * 4 * 64 * 21 / 1e6)
    assert e3.triton_tflops == pytest.approx(4 * 4 * 64 * 66 / 1e6)
    assert e1.max_err < 1e-5 and e3.max_err < 1e-5
    assert report.sdpa_note == "enable_gqa"
    assert "decode B x L" in B.table(report)
