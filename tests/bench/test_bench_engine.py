"""Smoke test of `python -m pddgw.bench.engine` on its --quick setting (no timing assertions).

Pins: the JSON shape (one row per case, token counts derived from the
settings, ratio = pddgw tok/s / transformers tok/s; the sampled decode rows
right after their greedy twins, with ratio_greedy = sampled / greedy pddgw
tok/s; the pddgw-only penalties and JSON-schema rows right after the plain
sampled one, with ratio_sampled = variant / plain sampled pddgw tok/s, and
that those variants do reach the engine: penalties move tokens, the mask keeps
every output a valid prefix of its schema), that both engines are fed the same
checkpoint and produce the same greedy tokens (which are also the naive full-recompute generator's), that
pddgw's sampled case samples what a dense recompute and the sampler give,
and that `tokens_match` does report a difference when the weights differ.  The vLLM column: absent -> the report
says so; its subprocess protocol (pddgw/harness/vllm_side.py) driven through a
fake `vllm` package whose "engine" is the naive generator.  And
scripts/gpu_check.sh: valid bash, rc 2 with a clear message without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from pddgw.bench import engine as bench  # noqa: E402
from pddgw.engines.grammar import Grammars  # noqa: E402
from pddgw.harness.sides import (PddgwSide, Run, TransformersSide, VllmSide, VllmUnavailable,  # noqa: E402
                                 build_checkpoint, engine_overrides, json_schema, make_prompts)
from pddgw.engines.naive import naive_greedy  # noqa: E402
from pddgw.engines.tokenizer import ByteTokenizer  # noqa: E402
from pddgw.engines.sampler import sample_one  # noqa: E402
from pddgw.engines.types import SamplingParams  # noqa: E402
from pddgw.engines.weights import load_model  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    build_checkpoint(bench.QUICK.model, str(d))
    ours, _ = load_model(str(d), torch.float32, "cpu")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, ours, theirs


REPO = Path(__file__).resolve().parents[2]
NO_VLLM = "vLLM: not available (--vllm-python not given)"


def test_main_quick_json(capsys, monkeypatch):
    monkeypatch.delenv("PDDGW_VLLM_PYTHON", raising=False)
    report = bench.main(["--quick", "--json"])
    data = json.loads(capsys.readouterr().out)
    s = bench.QUICK
    assert data["benchmark"] == "engine" and data["dtype"] == "float32"
    assert data["threads"] == torch.get_num_threads()
    assert data["settings"]["model"]["vocab_size"] == s.model.vocab_size
    assert data["settings"]["decode_batches"] == [1, 8, 32]
    assert data["settings"]["sampled_batches"] == [8, 32]
    assert data["settings"]["sampling"] == {"temperature": 0.8, "top_p": 0.95, "seed": 0}
    assert data["settings"]["variant_batches"] == [32]
    rows = data["rows"]
    assert [r["case"] for r in rows] == ["decode b=1", "decode b=8", "decode b=8 sampled", "decode b=32",
                                         "decode b=32 sampled", "decode b=32 sampled +penalties",
                                         "decode b=32 sampled +json_schema", f"prefill b={s.prefill_batch}"]
    # The variant rows: pddgw only, each against the plain sampled row of its batch.
    plain, variants = rows[4], rows[5:7]
    for r, name in zip(variants, ("penalties", "json_schema")):
        assert r["variant"] == name and r["sampling"] == plain["sampling"]
        assert r["ratio_sampled"] == pytest.approx(r["pddgw_tok_s"] / plain["pddgw_tok_s"])
        assert r["ratio_greedy"] == pytest.approx(r["pddgw_tok_s"] / rows[3]["pddgw_tok_s"])
        assert (r["transformers_s"], r["transformers_tok_s"], r["ratio"], r["tokens_match"]) == (None,) * 4
    assert all(r["variant"] is None and r["ratio_sampled"] is None for r in rows[:5] + rows[7:])
    rows = rows[:5] + rows[7:]
    for r, b in zip(rows[:5], (1, 8, 8, 32, 32)):
        assert (r["kind"], r["batch"], r["prompt_len"], r["output_len"]) == (
            "decode", b, s.decode_prompt_len, s.decode_output_len)
        assert r["measured_tokens"] == b * (s.decode_output_len - 1)
    for greedy, sampled in ((rows[1], rows[2]), (rows[3], rows[4])):
        assert greedy["sampling"] == "greedy" and greedy["ratio_greedy"] is None
        assert sampled["sampling"] == "temperature=0.8 top_p=0.95 seed=0+i"
        assert sampled["ratio_greedy"] == pytest.approx(sampled["pddgw_tok_s"] / greedy["pddgw_tok_s"])
        assert sampled["tokens_match"] is None              # transformers samples with its own RNG
    pre = rows[5]
    assert (pre["kind"], pre["batch"], pre["prompt_len"], pre["output_len"]) == (
        "prefill", s.prefill_batch, s.prefill_prompt_len, 1)
    assert pre["measured_tokens"] == s.prefill_batch * s.prefill_prompt_len
    for r in rows:
        assert r["tokens_match"] is (None if r["sampling"] != "greedy" else True), r["case"]
        assert r["pddgw_s"] > 0 and r["transformers_s"] > 0
        assert r["pddgw_tok_s"] == pytest.approx(r["measured_tokens"] / r["pddgw_s"])
        assert r["transformers_tok_s"] == pytest.approx(r["measured_tokens"] / r["transformers_s"])
        assert r["ratio"] == pytest.approx(r["pddgw_tok_s"] / r["transformers_tok_s"])
        assert r["vllm_tok_s"] is None and r["ratio_vllm"] is None
        assert r["vllm_tokens_match"] is None
        assert r["equal_requests"] == (None if r["sampling"] != "greedy" else {"pddgw=transformers": r["batch"]})
        b = r["breakdown"]
        assert b["steps"] == (1 if r["kind"] == "prefill" else s.decode_output_len - 1)
        parts = sum(b[k] for k in ("scheduling_ms", "pack_ms", "attention_ms", "model_other_ms",
                                   "sampling_ms"))
        assert parts == pytest.approx(b["step_ms"])
        assert b["attention_ms"] > 0 and b["model_other_ms"] > 0 and b["sampling_ms"] > 0
    assert f"vLLM: {data['vllm']}" == NO_VLLM and data["vllm_version"] is None
    assert data["device"] == "cpu" and data["cuda_graphs"] == "default"
    table = bench.render(report)
    for r in data["rows"]:
        assert r["case"] in table
    assert "tokens_match" in table and "sampled/greedy" in table and "NO" not in table
    assert "sampled: temperature 0.8, top_p 0.95, no top-k" in table
    assert NO_VLLM in table.splitlines()
    assert "sched/bookkeeping" in table and "/sampled" in table
    equal = table.split("greedy requests with the same tokens to the end, of the batch, every repeat\n")[1]
    assert [ln.split() for ln in equal.split("\n\n")[0].splitlines()[-4:]] == [
        ["decode", "b=1", "1/1"], ["decode", "b=8", "8/8"], ["decode", "b=32", "32/32"],
        ["prefill", f"b={s.prefill_batch}", f"{s.prefill_batch}/{s.prefill_batch}"]]
    assert "+penalties: repetition 1.1, presence 0.5, frequency 0.5" in table


def test_variants_ask_the_engine_for_penalties_and_a_json_schema_mask(models):
    _d, ours, _ = models
    s, n = bench.Sampling(), 24
    prompts = make_prompts(3, 9, bench.QUICK.model.vocab_size, salt=7)
    side = PddgwSide(ours, torch.float32)
    pen, js = bench.VARIANTS
    params = bench.Case("decode", 3, 9, n, s, pen).params(1)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.1, 0.5, 0.5)
    assert params.ignore_eos and params.seed == 1 and params.grammar is None
    plain = side.run(prompts, n, sampling=s)
    penalized = side.run(prompts, n, sampling=s, variant=pen)
    assert penalized.tokens != plain.tokens            # same seeds and draws: the penalties moved tokens
    masked = side.run(prompts, n, sampling=s, variant=js)
    assert masked.tokens != plain.tokens
    params = bench.Case("decode", 3, 9, n, s, js).params(0)
    assert params.grammar == ("json_schema", json_schema(n)) and not params.ignore_eos
    vocab = bench.QUICK.model.vocab_size
    grammars = Grammars(ByteTokenizer(vocab), vocab, (ByteTokenizer.EOS,))
    for toks in masked.tokens:
        # Bytes only (the matcher's vocabulary), each output a valid prefix of the schema's object.
        assert all(t < 256 for t in toks) and len(toks) == n and bytes(toks).startswith(b'{"name":')
        c = grammars.constraint(params.grammar)
        c.sync(toks)
        assert not c.broken and not c.finished
    assert json.loads(params.grammar[1])["properties"]["name"]["minLength"] == n


def test_both_sides_generate_the_naive_greedy_tokens(models):
    _d, ours, theirs = models
    prompts = make_prompts(3, 9, bench.QUICK.model.vocab_size, salt=7)
    a = PddgwSide(ours, torch.float32).run(prompts, 6)
    b = TransformersSide(theirs).run(prompts, 6)
    expected = tuple(tuple(naive_greedy(ours, p, 6)) for p in prompts)
    assert a.tokens == expected
    assert b.tokens == expected
    assert len(set(expected)) == 3               # distinct prompts, distinct continuations
    for run in (a, b):
        assert 0 < run.to_first <= run.total
        assert run.seconds("prefill") == run.to_first
        assert run.seconds("decode") == pytest.approx(run.total - run.to_first)


def test_sampled_case_samples_what_a_dense_recompute_and_the_sampler_give(models):
    # float64 (clear margins: the draw never lands on a rounding difference of the two paths).
    d, _, _ = models
    ours64, _ = load_model(str(d), torch.float64, "cpu")
    s = bench.Sampling()
    prompts = make_prompts(3, 9, bench.QUICK.model.vocab_size, salt=7)
    side = PddgwSide(ours64, torch.float64)
    run = side.run(prompts, 6, sampling=s)
    assert side.run(prompts, 6, sampling=s).tokens == run.tokens        # position-keyed: repeats
    for i, p in enumerate(prompts):
        seq, params = list(p), s.params(i, 6)
        assert params == SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, top_p=0.95, seed=i)
        for pos in range(6):
            logits = ours64.forward_dense(torch.tensor(seq))[-1]
            seq.append(sample_one(logits, params, pos))
        assert run.tokens[i] == tuple(seq[len(p):])
    assert run.tokens != side.run(prompts, 6).tokens                     # not the greedy tokens


def test_cases_put_each_sampled_decode_after_its_greedy_twin_with_its_prompts():
    s = bench.QUICK
    todo = bench.cases(s)
    assert [c.label for c in todo] == ["decode b=1", "decode b=8", "decode b=8 sampled", "decode b=32",
                                       "decode b=32 sampled", "decode b=32 sampled +penalties",
                                       "decode b=32 sampled +json_schema", "prefill b=2"]
    prompts = bench.case_prompts(todo, s.model.vocab_size)
    assert prompts[1] == prompts[2] and prompts[3] == prompts[4] == prompts[5] == prompts[6]
    assert prompts[1] != prompts[3]
    # The greedy cases keep the prompts they had before the sampled rows (salt = their order).
    assert prompts[3] == make_prompts(32, s.decode_prompt_len, s.model.vocab_size, 2)
    assert prompts[7] == make_prompts(2, s.prefill_prompt_len, s.model.vocab_size, 3)
    with pytest.raises(ValueError, match="must be decode batches"):
        bench.Settings(model=s.model, decode_batches=(1, 8), decode_prompt_len=8, decode_output_len=4,
                       prefill_batch=2, prefill_prompt_len=16, repeats=1, sampled_batches=(32,))
    with pytest.raises(ValueError, match="must be sampled batches"):
        bench.Settings(model=s.model, decode_batches=(1, 8), decode_prompt_len=8, decode_output_len=4,
                       prefill_batch=2, prefill_prompt_len=16, repeats=1, sampled_batches=(8,))


def test_sides_that_only_decode_greedily_sit_out_the_sampled_cases(models):
    _d, ours, theirs = models

    class GreedyOnly:
        name, samples, calls = "vllm", False, 0

        def run(self, prompts, output_len, sampling=None):
            assert sampling is None
            GreedyOnly.calls += 1
            return Run(0.01, 0.02, tuple(tuple(naive_greedy(ours, p, output_len)) for p in prompts))

    todo = [bench.Case("decode", 2, 8, 3), bench.Case("decode", 2, 8, 3, bench.Sampling())]
    prompts = [make_prompts(2, 8, bench.QUICK.model.vocab_size, salt=3)] * 2
    sides = (PddgwSide(ours, torch.float32), TransformersSide(theirs), GreedyOnly())
    greedy, sampled = bench.measure(sides, todo, prompts, repeats=1, progress=lambda _m: None)
    assert GreedyOnly.calls == 1
    assert (greedy.tokens_match, greedy.vllm_tokens_match, greedy.vllm_tok_s is not None) == (True, True, True)
    assert (sampled.tokens_match, sampled.vllm_tokens_match, sampled.vllm_tok_s, sampled.ratio_vllm) == (
        None, None, None, None)
    assert sampled.ratio_greedy == pytest.approx(sampled.pddgw_tok_s / greedy.pddgw_tok_s)
    assert greedy.equal_requests == {"pddgw=transformers": 2, "pddgw=vllm": 2, "transformers=vllm": 2}
    assert sampled.equal_requests is None


def test_equal_requests_counts_a_request_equal_in_every_repeat_per_pair():
    a, b, c = (1, 2), (1, 3), (4, 5)
    outputs = {"vllm": [(a, b, c), (a, b, c)],            # two repeats of a batch of 3
               "pddgw": [(a, b, c), (a, c, c)],          # request 1 differs in the second repeat
               "transformers": [(a, c, b), (a, c, b)]}
    assert bench.equal_requests(outputs) == {"pddgw=transformers": 1, "pddgw=vllm": 2, "transformers=vllm": 1}
    assert bench.equal_requests({"pddgw": [(a,)]}) == {}


def test_tokens_match_reports_a_difference(models):
    d, ours, _ = models
    # Negated output head: transformers now picks the argmin, pddgw the argmax.
    flipped = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        flipped.lm_head.weight.neg_()
    case = bench.Case("decode", 2, 8, 3)
    prompts = [make_prompts(2, 8, bench.QUICK.model.vocab_size, salt=3)]
    sides = (PddgwSide(ours, torch.float32), TransformersSide(flipped))
    (row,) = bench.measure(sides, [case], prompts, repeats=2, progress=lambda _m: None)
    assert row.tokens_match is False
    assert row.equal_requests == {"pddgw=transformers": 0}
    assert row.measured_tokens == 4
    assert "NO" in bench.format_table(["case", "tokens_match"], [(row.case, row.tokens_match)])


FAKE_VLLM = """
__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, **kw):
        assert kw["temperature"] == 0.0 and kw["ignore_eos"] and kw["min_tokens"] == kw["max_tokens"]
        self.max_tokens = kw["max_tokens"]


class _Completion:
    def __init__(self, ids):
        self.token_ids = ids


class _Output:
    def __init__(self, rid, ids):
        self.request_id, self.outputs = rid, [_Completion(ids)]


class _Engine:
    def __init__(self, model):
        self.model, self.todo = model, {}

    def add_request(self, rid, prompt, params):
        from pddgw.engines.naive import naive_greedy
        self.todo[rid] = [naive_greedy(self.model, prompt["prompt_token_ids"], params.max_tokens), 0]

    def has_unfinished_requests(self):
        return bool(self.todo)

    def step(self):  # one token per request per step, cumulative outputs as vLLM's
        out = []
        for rid, st in list(self.todo.items()):
            st[1] += 1
            out.append(_Output(rid, st[0][:st[1]]))
            if st[1] == len(st[0]):
                del self.todo[rid]
        return out


class LLM:
    def __init__(self, model, skip_tokenizer_init, enable_prefix_caching, **kw):
        import torch
        from pddgw.engines.weights import load_model
        assert skip_tokenizer_init and not enable_prefix_caching
        self.llm_engine = _Engine(load_model(model, torch.float32, "cpu")[0])
"""


@pytest.fixture
def fake_vllm_python(tmp_path):
    """A "vLLM python": this interpreter with a fake `vllm` package (and pddgw) importable."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    py = tmp_path / "python"
    py.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path}:{REPO}" exec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    return str(py)


def test_vllm_side_protocol_with_a_fake_vllm(models, fake_vllm_python, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    d, ours, _ = models
    side = VllmSide(fake_vllm_python, str(d), "float32", threads=1, max_model_len=256,
                    max_num_seqs=4, max_num_batched_tokens=256)
    try:
        assert side.info["vllm_version"] == "0.0-fake"
        assert (side.info["omp_threads"], side.info["threads_bind"]) == ("1", "nobind")
        prompts = make_prompts(3, 9, bench.QUICK.model.vocab_size, salt=7)
        for _ in range(2):                               # one vLLM engine serves every run
            run = side.run(prompts, 5)
            assert run.tokens == tuple(tuple(naive_greedy(ours, p, 5)) for p in prompts)
            assert 0 < run.to_first <= run.total
    finally:
        side.close()
    assert side._proc.returncode == 0


def test_vllm_side_unavailable_says_why(tmp_path, models):
    d, _, _ = models
    with pytest.raises(VllmUnavailable, match="cannot start"):
        VllmSide(str(tmp_path / "no-python"), str(d), "float32", 1, 256, 4, 256)
    # A python without vLLM: the child's import error comes back as the reason.
    with pytest.raises(VllmUnavailable, match="No module named 'vllm'"):
        VllmSide(sys.executable, str(d), "float32", 1, 256, 4, 256)


def test_the_vllm_env_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(REPO / "scripts" / "make_vllm_env.sh")], check=True)


def test_cuda_graphs_reach_the_engine_config_only_on_cuda():
    assert engine_overrides(None, "cpu") == ({}, "default")
    assert engine_overrides("off", "cpu") == ({"cuda_graphs": False}, "off")
    assert engine_overrides("on", "cuda:0") == ({"cuda_graphs": True}, "on")
    assert engine_overrides("on", "cpu") == ({}, "on ignored: CUDA graphs need a CUDA device, not 'cpu'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_device_cuda_without_cuda_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--quick", "--device", "cuda"])
    assert e.value.code == 2
    assert "sees no CUDA device" in capsys.readouterr().err
