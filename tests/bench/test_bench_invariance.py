"""Smoke test of `python -m pddgw.bench.invariance --quick` (structure, no timings).

Pins: one result per (dtype, path) in order, counts derived from the
settings (logits compared at every position of equal context: all outputs,
or those after the extend), fractions = differing / requests, one result per
(dtype, op); float32 greedy tokens identical on every path (the tiny model's
margins; bit differences in the logits are reported, not pinned: they
depend on the CPU's kernels); the divergence bookkeeping on made-up tokens.
"""

from __future__ import annotations

import json

import pytest

from pddgw.bench import invariance as inv

OPS = ["linear packed", "linear F.linear", "rms_norm", "decode attn", "extend vs decode", "chunked extend"]


@pytest.fixture(scope="module")
def quick():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report = inv.main(["--quick", "--json"])
    return report, json.loads(out.getvalue())


def test_quick_json_structure(quick):
    report, data = quick
    s = inv.QUICK
    assert data["benchmark"] == "invariance" and data["device"] == "cpu"
    assert data["settings"]["dtypes"] == ["bfloat16", "float32"]
    assert [(p["dtype"], p["path"]) for p in data["paths"]] == [
        (d, p) for d in ("bfloat16", "float32") for p in ("batch", "mixed", "extend", "chunked")]
    for p in data["paths"]:
        assert p["requests"] == s.num_prompts
        assert p["fraction"] == p["differing"] / s.num_prompts
        assert (p["first_divergence_min"] is None) == (p["differing"] == 0)
        assert 0 <= p["logits_differing"] <= p["logits_compared"]
        if p["differing"] == 0:
            start = s.extend_tokens if p["path"] == "extend" else 0
            assert p["logits_compared"] == s.num_prompts * (s.output_len - start)
        else:
            assert p["first_divergence_min"] >= (s.extend_tokens if p["path"] == "extend" else 0)
    assert [(o["dtype"], o["op"]) for o in data["ops"]] == [
        (d, op) for d in ("bfloat16", "float32") for op in OPS]
    for o in data["ops"]:
        assert o["trials"] == s.op_trials and 0 <= o["differing"] <= s.op_trials
        assert o["fraction"] == o["differing"] / s.op_trials
    table = inv.render(report)
    for word in ("tokens differ", "first div mean", "logits differ", "reductions, bit comparisons",
                 "extend vs decode"):
        assert word in table


def test_float32_greedy_tokens_are_the_same_on_every_path(quick):
    _, data = quick
    f32 = [p for p in data["paths"] if p["dtype"] == "float32"]
    assert [(p["path"], p["differing"]) for p in f32] == [
        ("batch", 0), ("mixed", 0), ("extend", 0), ("chunked", 0)]


def test_divergence_bookkeeping():
    assert inv.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert inv.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert inv.first_divergence([1, 2, 3], [1, 2]) == 2
    alone = [[1, 2, 3, 4], [5, 6, 7, 8]]
    other = [[1, 2, 3, 4], [5, 6, 0, 8]]
    ref = {(i + 1, pos): bytes([pos]) for i in range(2) for pos in range(4)}
    got = dict(ref)
    got[(1, 3)] = b"x"              # request 0: logits differ at its last position, tokens do not
    got[(2, 2)] = b"y"              # request 1: diverges at 2; positions after it are not compared
    got[(2, 3)] = b"z"
    r = inv.compare("bfloat16", "batch", alone, other, ref, got, start=0)
    assert (r.requests, r.differing, r.fraction) == (2, 1, 0.5)
    assert (r.first_divergence_mean, r.first_divergence_min) == (2.0, 2)
    assert (r.logits_compared, r.logits_differing) == (4 + 3, 2)
    r = inv.compare("bfloat16", "extend", alone, other, ref, got, start=2)
    assert (r.logits_compared, r.logits_differing) == (2 + 1, 2)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="extend_tokens"):
        inv.Settings(num_prompts=1, output_len=4, extend_tokens=4, filler=0, chunk=4, prompt_lens=(1, 2),
                     dtypes=("float32",), op_trials=1)
    with pytest.raises(ValueError, match="unknown dtypes"):
        inv.Settings(num_prompts=1, output_len=4, extend_tokens=2, filler=0, chunk=4, prompt_lens=(1, 2),
                     dtypes=("float8",), op_trials=1)


def test_shared_prompts_and_engine_sizing_are_the_benchmarks_own_formulas():
    import torch

    from pddgw.harness.engines import BLOCK_SIZE, engine_config, random_prompts

    # Drawn lengths, then ids, from one generator (invariance's prompts and fillers).
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(4, 25, (6,), generator=g).tolist()
    assert random_prompts(5, 6, (4, 24), inv.PRINTABLE) == [
        torch.randint(32, 127, (n,), generator=g).tolist() for n in lens]
    # A fixed length: one [batch, length] draw (bench.engine's prompts).
    g = torch.Generator().manual_seed(1003)
    assert random_prompts(1003, 32, 8, (3, 512)) == torch.randint(3, 512, (32, 8), generator=g).tolist()
    cfg = engine_config(3, 2 * BLOCK_SIZE + 1, "cpu")
    assert (cfg.num_blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens) == (3 * 3 + 1, 3, 3 * 33)
    cfg = engine_config(2, 16, "cpu", 4, enable_prefix_caching=False)
    assert (cfg.num_blocks, cfg.max_num_batched_tokens, cfg.enable_prefix_caching) == (3, 4, False)


def test_negative_counts_are_usage_errors_naming_the_flags(capsys):
    with pytest.raises(SystemExit) as e:
        inv.main(["--quick", "--output-len", "-2"])
    assert e.value.code == 2
    assert "error: --prompts, --output-len and --threads must be >= 0" in capsys.readouterr().err
