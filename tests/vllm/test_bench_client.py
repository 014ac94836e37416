"""vLLM's own load generator, unmodified, against `pddgw serve --model tiny`.

`vllm bench serve` runs a small random dataset through each OpenAI route it speaks
(`openai` on /v1/completions, `openai-chat` on /v1/chat/completions, `openai-responses`
on /v1/responses); every request must succeed.  The tokenizer it needs is the tiny
model's, written by `pddgw export-model`.  Its figures (req/s, TTFT, TPOT) are printed
for the record; only the counts are asserted (a loaded 2-core machine sets the speed).

Not through the `vllm` console script, which fails in vLLM's CPU build: through
`pddgw.bench.serve.BENCH_SERVE`, exactly as `vllm bench serve` wires it
(vllm/entrypoints/cli/benchmark/serve.py) — the same client code, nothing of it replaced
(that module's docstring says why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pddgw.bench.serve import BENCH_SERVE
from tests.clients.served import serve_tiny

PROMPTS = 20
INPUT_LEN, OUTPUT_LEN = 32, 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_tiny(tmp_path_factory.mktemp("bench-serve")) as s:
        yield s


def backends() -> list[str]:
    """The --backend choices of this vLLM's benchmark."""
    from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS

    return list(ASYNC_REQUEST_FUNCS)


@pytest.mark.parametrize("backend, endpoint", [
    ("openai", "/v1/completions"),
    ("openai-chat", "/v1/chat/completions"),
    ("openai-responses", "/v1/responses"),
])
def test_vllm_bench_serve_every_request_succeeds(server, tmp_path, backend, endpoint):
    assert backend in backends(), f"vLLM 0.32's bench serve offers --backend {backend}"
    args = ["--backend", backend, "--base-url", server.base, "--endpoint", endpoint, "--model", server.model,
            "--tokenizer", server.tokenizer_dir, "--dataset-name", "random",
            "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
            "--num-prompts", str(PROMPTS), "--max-concurrency", "4", "--seed", "0",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"]
    env = {**os.environ, "OPENAI_API_KEY": "unused"}
    run = subprocess.run([sys.executable, "-c", BENCH_SERVE, *args], capture_output=True, text=True, timeout=600,
                         env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads((tmp_path / "bench.json").read_text())
    print(f"{backend}: {res['completed']} ok, {res['failed']} failed, {res['request_throughput']:.2f} req/s, "
          f"TTFT mean {res['mean_ttft_ms']:.1f} ms, TPOT mean {res['mean_tpot_ms']:.1f} ms")
    assert (res["completed"], res["failed"]) == (PROMPTS, 0), [e for e in res.get("errors", []) if e][:3]
    assert PROMPTS <= res["total_output_tokens"] <= PROMPTS * OUTPUT_LEN      # each got 1..max_tokens tokens
    assert "request_refused" not in server.log()
