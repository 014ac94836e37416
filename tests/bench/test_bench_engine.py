"""Smoke test of `python -m pddgw.bench.engine` on its --quick setting (no timing assertions).

Pins: the JSON shape (one row per case, token counts derived from the
settings, ratio = pddgw tok/s / transformers tok/s), that both engines are fed
the same checkpoint and produce the same greedy tokens (which are also the
naive full-recompute generator's), and that `tokens_match` does report a
difference when the weights differ.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from pddgw.bench import engine as bench  # noqa: E402
from pddgw.engines.naive import naive_greedy  # noqa: E402
from pddgw.engines.weights import load_model  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    bench.build_checkpoint(bench.QUICK.model, str(d))
    ours, _ = load_model(str(d), torch.float32, "cpu")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, ours, theirs


def test_main_quick_json(capsys):
    report = bench.main(["--quick", "--json"])
    data = json.loads(capsys.readouterr().out)
    s = bench.QUICK
    assert data["benchmark"] == "engine" and data["dtype"] == "float32"
    assert data["threads"] == torch.get_num_threads()
    assert data["settings"]["model"]["vocab_size"] == s.model.vocab_size
    assert data["settings"]["decode_batches"] == [1, 8, 32]
    rows = data["rows"]
    assert [r["case"] for r in rows] == ["decode b=1", "decode b=8", "decode b=32",
                                         f"prefill b={s.prefill_batch}"]
    for r, b in zip(rows[:3], (1, 8, 32)):
        assert (r["kind"], r["batch"], r["prompt_len"], r["output_len"]) == (
            "decode", b, s.decode_prompt_len, s.decode_output_len)
        assert r["measured_tokens"] == b * (s.decode_output_len - 1)
    pre = rows[3]
    assert (pre["kind"], pre["batch"], pre["prompt_len"], pre["output_len"]) == (
        "prefill", s.prefill_batch, s.prefill_prompt_len, 1)
    assert pre["measured_tokens"] == s.prefill_batch * s.prefill_prompt_len
    for r in rows:
        assert r["tokens_match"] is True, r["case"]
        assert r["pddgw_s"] > 0 and r["transformers_s"] > 0
        assert r["pddgw_tok_s"] == pytest.approx(r["measured_tokens"] / r["pddgw_s"])
        assert r["transformers_tok_s"] == pytest.approx(r["measured_tokens"] / r["transformers_s"])
        assert r["ratio"] == pytest.approx(r["pddgw_tok_s"] / r["transformers_tok_s"])
    table = bench.render(report)
    for r in rows:
        assert r["case"] in table
    assert "tokens_match" in table and "NO" not in table


def test_both_sides_generate_the_naive_greedy_tokens(models):
    _d, ours, theirs = models
    prompts = bench.make_prompts(3, 9, bench.QUICK.model.vocab_size, salt=7)
    a = bench.PddgwSide(ours, torch.float32).run(prompts, 6)
    b = bench.TransformersSide(theirs).run(prompts, 6)
    expected = tuple(tuple(naive_greedy(ours, p, 6)) for p in prompts)
    assert a.tokens == expected
    assert b.tokens == expected
    assert len(set(expected)) == 3               # distinct prompts, distinct continuations
    for run in (a, b):
        assert 0 < run.to_first <= run.total
        assert run.seconds("prefill") == run.to_first
        assert run.seconds("decode") == pytest.approx(run.total - run.to_first)


def test_tokens_match_reports_a_difference(models):
    d, ours, _ = models
    # Negated output head: transformers now picks the argmin, pddgw the argmax.
    flipped = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        flipped.lm_head.weight.neg_()
    case = bench.Case("decode", 2, 8, 3)
    prompts = [bench.make_prompts(2, 8, bench.QUICK.model.vocab_size, salt=3)]
    sides = (bench.PddgwSide(ours, torch.float32), bench.TransformersSide(flipped))
    (row,) = bench.measure(sides, [case], prompts, repeats=2, progress=lambda _m: None)
    assert row.tokens_match is False
    assert row.measured_tokens == 4
    assert "NO" in bench.format_table(["case", "tokens_match"], [(row.case, row.tokens_match)])
