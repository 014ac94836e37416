"""lm-eval, unmodified, scoring a log-likelihood task through /v1/completions.

lm-eval's `local-completions` model (its OpenAI-completions client) runs the multiple-choice
task in lm_eval_task/ (four local documents, ten question -> choice pairs; nothing is
downloaded) against `pddgw serve --model tiny`.  For each pair it sends one token-ID prompt
(context + continuation) with echo, logprobs 1 and max_tokens 1, and sums the echoed
logprobs of the continuation tokens.  Each of those sums must equal what `pddgw generate
--prompt-ids ... --prompt-logprobs 1 --json` reports for the same ids (the same float32
weights on one local engine), to float32 tolerance, its greedy flag must match, and its
accuracy must be the one those sums imply.

lm-eval pulls datasets, pandas, pyarrow, scipy and scikit-learn, so it lives in `.ci/run`'s
second environment (the `lm-eval` extra next to vLLM, installed while the main suite runs);
elsewhere this test skips unless PDDGW_REQUIRE_LM_EVAL is set.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from pddgw import cli
from tests.clients.served import serve_tiny

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = Path(__file__).with_name("lm_eval_task")
TASK = "pddgw_tiny_choice"
DOCS = [json.loads(line) for line in (TASK_DIR / "docs.jsonl").read_text().splitlines()]
TOL = 1e-4          # float32 logprobs (|lp| ~ 20) summed; one engine and the other, maybe batched apart

if not os.environ.get("PDDGW_REQUIRE_LM_EVAL") and importlib.util.find_spec("lm_eval") is None:
    pytest.skip("lm-eval is not installed in this environment (the `lm-eval` extra; see .ci/run)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_tiny(tmp_path_factory.mktemp("lm-eval")) as s:
        yield s


def generate_prompt_logprobs(ids: list[int], capsys) -> list[dict | None]:
    """`pddgw generate --prompt-ids IDS --prompt-logprobs 1 --json` -> its prompt_logprobs."""
    capsys.readouterr()
    rc = cli.main(["generate", "--model", "tiny", "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "1",
                   "--prompt-logprobs", "1", "--json"])
    assert rc == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["prompt_token_ids"] == ids
    return obj["prompt_logprobs"]


def test_lm_eval_loglikelihoods_equal_pddgw_generate_prompt_logprobs(server, tmp_path, monkeypatch, capsys):
    # Before lm-eval (and datasets) first load: no hub, and the json builder's cache in tmp.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    monkeypatch.chdir(ROOT)                  # the task's data_files path is relative to the repository
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    lm = LocalCompletionsAPI(base_url=f"{server.base}/v1/completions", model=server.model,
                             tokenizer=server.tokenizer_dir, tokenizer_backend="huggingface", max_length=512)
    out = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=TaskManager(include_path=str(TASK_DIR)),
                                  log_samples=True, bootstrap_iters=0)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    assert [s["doc"] for s in samples] == DOCS

    hits, worst = [], 0.0
    for s in samples:
        lls = []
        for (ctx, cont), (ll, greedy) in zip(s["arguments"], s["filtered_resps"], strict=True):
            ctx_ids, cont_ids = lm._encode_pair(ctx, cont)        # what lm-eval sent, split where it splits
            assert ctx_ids and cont_ids
            lps = generate_prompt_logprobs([*ctx_ids, *cont_ids], capsys)[len(ctx_ids):]
            want = sum(lp["logprob"] for lp in lps)
            assert abs(ll - want) < TOL, (ctx, cont, ll, want)
            worst = max(worst, abs(ll - want))
            assert greedy == all(lp["top"][0][0] == t for lp, t in zip(lps, cont_ids, strict=True)), (ctx, cont)
            lls.append(want)
        hits.append(float(max(range(len(lls)), key=lls.__getitem__) == s["target"]))
    print(f"lm-eval {TASK}: acc {out['results'][TASK]['acc,none']:.3f}, "
          f"largest |lm-eval - pddgw generate| {worst:.2e}")
    assert sum(len(s["arguments"]) for s in samples) == sum(len(d["choices"]) for d in DOCS) == 10
    assert out["results"][TASK]["acc,none"] == pytest.approx(sum(hits) / len(hits))
    assert "request_refused" not in server.log()
