"""`python -m pddgw.bench.serve` end to end against `pddgw serve --model tiny` alone.

The whole path a user runs: export the model, start the server, time it to /health,
vLLM's own client against it, the row from the client's result JSON, the table.  Only
counts are asserted (a loaded 2-core machine sets the speed).  `vllm serve` is left
out: vLLM's CPU attention refuses the tiny model's head size (16).
"""

from __future__ import annotations

from pddgw.bench import serve

ARGS = ["--model", "tiny", "--servers", "pddgw", "--num-prompts", "4", "--random-input-len", "32",
        "--random-output-len", "8", "--max-concurrency", "2"]


def test_every_request_completes_and_the_table_has_the_pddgw_row(capsys):
    report = serve.main(ARGS)
    out = capsys.readouterr().out
    assert [(r.server, r.completed, r.failed) for r in report.rows] == [("pddgw", 4, 0)]
    assert report.rows[0].model_id == "pddgw-tiny" and report.notes == []
    lines = out.splitlines()
    assert lines[2] == "vllm: not run (--servers has no vllm)"
    assert [ln.split()[:2] for ln in lines[5:]] == [["pddgw", "4/0"]]
