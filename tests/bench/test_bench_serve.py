"""`python -m pddgw.bench.serve`: its pure parts (the run itself: tests/vllm/test_bench_serve_run.py)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
from io import StringIO
from pathlib import Path

import orjson
import pytest

from pddgw.bench import serve
from pddgw.bench.serve import Ratios, Report, Row, Workload
from pddgw.tables import emit

# What vLLM 0.32's `bench serve --save-result --percentile-metrics ttft,tpot,itl,e2el
# --metric-percentiles 50,99` writes (the per-request lists and itl/e2el keys left out).
RESULT = {
    "date": "20261205-191112", "endpoint_type": "openai-chat", "backend": "openai-chat", "label": None,
    "model_id": "pddgw-tiny", "tokenizer_id": "/tmp/x/model-hf", "num_prompts": 100, "request_rate": "inf",
    "burstiness": 1.0, "max_concurrency": 16, "duration": 25.0, "completed": 100, "failed": 0,
    "total_input_tokens": 25600, "total_output_tokens": 12500, "request_throughput": 4.0, "request_goodput": None,
    "output_throughput": 500.0, "total_token_throughput": 1524.0, "max_output_tokens_per_s": 640.0,
    "max_concurrent_requests": 16, "rtfx": 0.0,
    "mean_ttft_ms": 150.0, "median_ttft_ms": 125.0, "std_ttft_ms": 80.0, "p50_ttft_ms": 125.0, "p99_ttft_ms": 400.0,
    "mean_tpot_ms": 26.0, "median_tpot_ms": 25.0, "std_tpot_ms": 3.0, "p50_tpot_ms": 25.0, "p99_tpot_ms": 31.0,
}
OURS = Row("pddgw", "pddgw-tiny", 2.0, 100, 0, 4.0, 500.0, 125.0, 400.0, 25.0)
THEIRS = Row("vllm", "/tmp/x/model-hf", 50.0, 100, 0, 5.0, 625.0, 100.0, 320.0, 20.0)
HEAD = ("serving: vLLM's bench client (openai-chat /v1/chat/completions, random 256 in / 128 out, 100 prompts, "
        "concurrency 16, seed 1)")
COLUMNS = ["server  ok/failed  req/s  output tok/s  TTFT median ms  TTFT P99 ms  TPOT median ms  start-up to /health s",
           "------  ---------  -----  ------------  --------------  -----------  --------------  ---------------------",
           "pddgw       100/0   4.00         500.0           125.0        400.0            25.0                   2.00"]


def report(rows: list[Row], vllm: str, notes: list[str] | None = None) -> Report:
    runs = serve.run_ratios(rows)
    return Report("", "bfloat16", Workload(), rows, serve.median_ratios(runs), vllm, notes or [], runs)


def test_a_row_is_read_from_the_result_json():
    assert serve.row_from_result("pddgw", 2.0, RESULT) == OURS


def test_a_result_without_p99_names_the_key():
    with pytest.raises(KeyError, match="p99_ttft_ms"):
        serve.row_from_result("pddgw", 2.0, {k: v for k, v in RESULT.items() if k != "p99_ttft_ms"})


def test_ratios_are_pddgw_over_vllm():
    assert serve.ratios([OURS, THEIRS]) == Ratios(0.8, 1.25, 0.04)


def test_no_ratios_without_a_vllm_row_or_with_failed_requests():
    assert serve.ratios([OURS]) == Ratios(None, None, None)
    failed = Row("vllm", "/d", 50.0, 0, 100, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert serve.ratios([OURS, failed]) == Ratios(None, None, None)


def test_the_table_has_a_row_per_server_and_the_ratios():
    text = serve.render(report([OURS, THEIRS], "vLLM 0.32.0 (/venv/bin/python)"))
    assert text.splitlines() == [
        HEAD, "model: pddgw default  dtype: bfloat16", "vllm: vLLM 0.32.0 (/venv/bin/python)", *COLUMNS,
        "vllm        100/0   5.00         625.0           100.0        320.0            20.0                   50.0",
        "",
        "pddgw/vllm  output tok/s  TTFT P99  start-up",
        "----------  ------------  --------  --------",
        "ratio               0.80      1.25      0.04"]


def test_without_vllm_the_report_says_why_in_one_line():
    text = serve.render(report([OURS], "not run (--servers has no vllm)", ["pddgw serve exited during the run"]))
    assert text.splitlines() == [HEAD, "model: pddgw default  dtype: bfloat16", "vllm: not run (--servers has no vllm)",
                                 *COLUMNS, "pddgw serve exited during the run"]


def test_the_json_holds_the_workload_rows_ratios_and_why():
    out = StringIO()
    emit(report([OURS, THEIRS], "vLLM 0.32.0 (/venv/bin/python)"), True, "", out)
    got = orjson.loads(out.getvalue())
    assert sorted(got) == ["benchmark", "dtype", "model", "notes", "ratios", "rows", "runs", "vllm", "workload"]
    assert got["benchmark"] == "serve" and got["vllm"] == "vLLM 0.32.0 (/venv/bin/python)"
    assert got["workload"] == {"backend": "openai-chat", "endpoint": "/v1/chat/completions", "dataset_name": "random",
                               "random_input_len": 256, "random_output_len": 128, "num_prompts": 100,
                               "max_concurrency": 16, "seed": 1}
    assert got["rows"][0] == {"server": "pddgw", "model_id": "pddgw-tiny", "startup_s": 2.0, "completed": 100,
                              "failed": 0, "request_throughput": 4.0, "output_throughput": 500.0,
                              "median_ttft_ms": 125.0, "p99_ttft_ms": 400.0, "median_tpot_ms": 25.0, "run": 1}
    assert got["ratios"] == {"output_throughput": 0.8, "p99_ttft": 1.25, "startup": 0.04}
    assert got["runs"] == [got["ratios"]]


def test_the_client_is_asked_for_p50_and_p99_and_a_named_result_file():
    args = Workload(num_prompts=4, max_concurrency=2).client_args("http://127.0.0.1:9", "m", "/tok",
                                                                   Path("/r/pddgw-result.json"))
    assert args == ["--backend", "openai-chat", "--base-url", "http://127.0.0.1:9", "--endpoint",
                    "/v1/chat/completions", "--model", "m", "--tokenizer", "/tok", "--dataset-name", "random",
                    "--random-input-len", "256", "--random-output-len", "128", "--num-prompts", "4",
                    "--max-concurrency", "2", "--seed", "1", "--percentile-metrics", "ttft,tpot,itl,e2el",
                    "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--result-dir", "/r",
                    "--result-filename", "pddgw-result.json"]


def test_vllms_python_is_the_flag_then_the_environment_then_this_one(monkeypatch):
    monkeypatch.setenv("PDDGW_VLLM_PYTHON", "/env/python")
    assert serve.vllm_python("/flag/python") == "/flag/python"
    assert serve.vllm_python(None) == "/env/python"
    monkeypatch.delenv("PDDGW_VLLM_PYTHON")
    monkeypatch.setattr(serve, "find_spec", lambda name: None)
    assert serve.vllm_python(None) is None
    # A relative path holds from the scratch folder vLLM's server runs in; a bare name is looked up.
    monkeypatch.chdir("/tmp")
    assert serve.vllm_python(os.path.join("venv", "bin", "python")) == "/tmp/venv/bin/python"
    assert serve.vllm_python("python3") == "python3"


def test_without_any_vllm_environment_the_bench_exits_2_saying_why(monkeypatch, capsys):
    monkeypatch.delenv("PDDGW_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(serve, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as ei:
        serve.main(["--servers", "pddgw"])
    assert ei.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m pddgw.bench.serve: error: vLLM's benchmark client needs a vLLM environment: "
        "--vllm-python PATH or env PDDGW_VLLM_PYTHON")


@pytest.mark.parametrize("servers", ["sglang", "pddgw,pddgw", ""])
def test_servers_are_pddgw_or_vllm_each_once(capsys, servers):
    with pytest.raises(SystemExit) as ei:
        serve.main(["--servers", servers])
    assert ei.value.code == 2
    assert f"--servers {servers!r}: a comma-separated list of pddgw, vllm, each once" in capsys.readouterr().err


def test_the_first_error_of_a_log_is_its_root_cause_and_warnings_are_skipped():
    log = ("(APIServer pid=1) WARNING [system_utils.py:255] failed with error `OSError: [Errno 24] Too many`\n"
           "(Worker pid=2) ERROR [multiproc_executor.py:1063] RuntimeError: Unsupported CPU attention "
           "configuration: head_dim=16 isa=2 kv_cache_idx=0\n"
           "(APIServer pid=1) ERROR [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore "
           "encountered an issue.\n")
    assert serve.first_error(log) == "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 " \
                                     "kv_cache_idx=0"
    assert serve.first_error("starting\npddgw: error: --model: no such file\n") == "error: --model: no such file"
    assert serve.first_error("all well\n") == "(no error in its log)"


def test_a_model_that_does_not_export_is_one_line_and_exit_1(capsys):
    with pytest.raises(SystemExit) as ei:
        serve.main(["--model", "/nonexistent/model", "--servers", "pddgw", "--vllm-python", "/unused/python"])
    assert ei.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m pddgw.bench.serve: error: pddgw export-model failed: error: --model: /nonexistent/model: "
        "no such directory (expected a Hugging Face model directory: config.json, *.safetensors, tokenizer.json)")


def _run(k: int, p99: float, their_p99: float, tok_s: float = 500.0) -> list[Row]:
    """Run k's two rows: pddgw at `p99` ms and `tok_s`, vLLM at `their_p99` and 625 tok/s."""
    return [replace(OURS, p99_ttft_ms=p99, output_throughput=tok_s, run=k),
            replace(THEIRS, p99_ttft_ms=their_p99, run=k)]


def test_repeated_runs_pair_by_run_and_the_ratios_are_their_medians():
    rows = _run(1, 400.0, 320.0) + _run(2, 300.0, 400.0, 750.0) + _run(3, 500.0, 400.0, 625.0)
    runs = serve.run_ratios(rows)
    assert runs == [Ratios(0.8, 1.25, 0.04), Ratios(1.2, 0.75, 0.04), Ratios(1.0, 1.25, 0.04)]
    assert serve.median_ratios(runs) == Ratios(1.0, 1.25, 0.04)


def test_a_run_without_both_sides_leaves_the_median_out():
    rows = _run(1, 400.0, 320.0) + [replace(OURS, run=2)]
    runs = serve.run_ratios(rows)
    assert runs == [Ratios(0.8, 1.25, 0.04), Ratios(None, None, None)]
    assert serve.median_ratios(runs) == Ratios(None, None, None)
    assert serve.median_ratios([]) == Ratios(None, None, None)


def test_the_table_of_repeated_runs_names_each_run_and_the_median():
    text = serve.render(report(_run(1, 400.0, 320.0) + _run(2, 300.0, 400.0, 750.0), "vLLM 0.32.0 (/py)"))
    cells = [line.split("  ") for line in text.splitlines()[3:]]
    assert [[c.strip() for c in row if c.strip()] for row in cells] == [
        ["server", "run", "ok/failed", "req/s", "output tok/s", "TTFT median ms", "TTFT P99 ms", "TPOT median ms",
         "start-up to /health s"],
        ["------", "---", "---------", "-----", "------------", "--------------", "-----------", "--------------",
         "---------------------"],
        ["pddgw", "1", "100/0", "4.00", "500.0", "125.0", "400.0", "25.0", "2.00"],
        ["vllm", "1", "100/0", "5.00", "625.0", "100.0", "320.0", "20.0", "50.0"],
        ["pddgw", "2", "100/0", "4.00", "750.0", "125.0", "300.0", "25.0", "2.00"],
        ["vllm", "2", "100/0", "5.00", "625.0", "100.0", "400.0", "20.0", "50.0"],
        [],
        ["pddgw/vllm", "output tok/s", "TTFT P99", "start-up"],
        ["----------", "------------", "--------", "--------"],
        ["run 1", "0.80", "1.25", "0.04"],
        ["run 2", "1.20", "0.75", "0.04"],
        ["median", "1.00", "1.00", "0.04"]]


def test_repeats_must_run_each_server_once_at_least(capsys):
    with pytest.raises(SystemExit) as ei:
        serve.main(["--repeats", "0"])
    assert ei.value.code == 2
    assert "--repeats 0: runs each server at least once (>= 1)" in capsys.readouterr().err


def _fake_runs(monkeypatch, vllm_starts: bool) -> list[tuple[str, int]]:
    """run_benchmark with the export and each server's run replaced: -> the (server, run) calls made."""
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(serve.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "", ""))

    def bench_server(name, procs, python, workload, tokenizer, d, start_s, client_s, notes, run):
        calls.append((name, run))
        if name == "vllm" and not vllm_starts:
            raise serve.DidNotStart("vllm serve did not start: RuntimeError: no CPU attention")
        return replace(OURS if name == "pddgw" else THEIRS, run=run), "0.32.0" if name == "vllm" else ""

    monkeypatch.setattr(serve, "bench_server", bench_server)
    return calls


def test_the_servers_take_turns_each_run(monkeypatch):
    calls = _fake_runs(monkeypatch, vllm_starts=True)
    got = serve.run_benchmark("", "bfloat16", ["pddgw", "vllm"], "/py", Workload(), [], [], repeats=2)
    assert calls == [("pddgw", 1), ("vllm", 1), ("pddgw", 2), ("vllm", 2)]
    assert [(r.server, r.run) for r in got.rows] == calls
    assert got.runs == [Ratios(0.8, 1.25, 0.04)] * 2 and got.ratios == Ratios(0.8, 1.25, 0.04)
    assert got.vllm == "vLLM 0.32.0 (/py)"


def test_a_vllm_that_did_not_start_is_not_tried_again(monkeypatch):
    calls = _fake_runs(monkeypatch, vllm_starts=False)
    got = serve.run_benchmark("", "bfloat16", ["pddgw", "vllm"], "/py", Workload(), [], [], repeats=3)
    assert calls == [("pddgw", 1), ("vllm", 1), ("pddgw", 2), ("pddgw", 3)]
    assert got.vllm == "not available (vllm serve did not start: RuntimeError: no CPU attention)"
    assert got.ratios == Ratios(None, None, None)
