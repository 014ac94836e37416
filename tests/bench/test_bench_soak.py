"""`python -m pddgw.bench.soak`, CI-sized: the 4-process deployment under load, rld0 SIGKILLed and restarted.

Pins the JSON field set and the invariants every run must keep, faults or
not: every request ends (completed or an error event, none lost), every
token is what `pddgw generate` gives for that prompt (float64: no near-tie
flips), positions come once and in order, and once the load is over no node
holds a KV block, a pin or an in-flight entry.  Plus the fault grammar,
without processes (the proxy, leak accounting and reference it runs on:
tests/bench/test_harness.py).
"""

from __future__ import annotations

import orjson
import pytest

from pddgw.bench import soak

REPORT_FIELDS = {
    "deployment", "dtype", "concurrency", "duration_s", "max_tokens", "faults", "requests", "completed",
    "errors", "errors_by_code", "lost", "lost_by_reason", "wrong_tokens", "positions_not_in_order",
    "pipelines", "handoff_modes", "redriven", "router_counts", "distinct_prompts", "ttft_p50_ms",
    "ttft_p99_ms", "requests_per_s", "output_tokens_per_s", "load_s", "leaks", "rss", "examples",
    "stuck_state", "logs", "wall_s", "ok",
}
LEAK_FIELDS = {"quiet", "waited_s", "blocks", "pins", "inflight", "leftovers", "unhealthy_nodes"}
RSS_FIELDS = {"pid", "start_kb", "end_kb", "growth_kb", "kills", "restarts", "exit_code"}


@pytest.mark.slow
def test_four_processes_with_rld_killed_and_restarted(capsys):
    rc = soak.main(["--concurrency", "4", "--duration", "8", "--max-tokens", "16", "--singular-share", "0.2",
                    "--faults", "2:kill=rld0@1", "--grace", "20", "--quiet-timeout", "10", "--json"])
    rep = orjson.loads(capsys.readouterr().out)
    assert set(rep) == REPORT_FIELDS
    assert set(rep["leaks"]) == LEAK_FIELDS
    assert set(rep["rss"]) == {"router", "p0", "rld0", "md0"}
    assert all(set(r) == RSS_FIELDS for r in rep["rss"].values())
    assert rep["deployment"] == "4-process" and rep["dtype"] == "float64"

    # The invariants, exactly (the examples and the leftovers say what went wrong, the logs where).
    why = orjson.dumps({k: rep[k] for k in ("examples", "leaks", "stuck_state", "logs")}).decode()
    assert rep["lost"] == 0, why
    assert rep["wrong_tokens"] == 0, why
    assert rep["positions_not_in_order"] == 0, why
    leaks = rep["leaks"]
    assert leaks["quiet"] and leaks["leftovers"] == {}, why
    assert (leaks["blocks"], leaks["pins"], leaks["inflight"]) == (0, 0, 0), why
    assert leaks["unhealthy_nodes"] == []            # rld0 came back: every node was checked
    assert rep["ok"] is True and rc == 0 and rep["logs"] is None

    # Accounting: every request is counted once; the load ran and used the relay.
    assert rep["requests"] == rep["completed"] + rep["errors"] + rep["lost"]
    assert rep["errors"] == sum(rep["errors_by_code"].values())
    assert rep["completed"] > 0 and sum(rep["pipelines"].values()) == rep["completed"]
    assert "P-RLD-MD" in rep["pipelines"]
    assert 0 < rep["ttft_p50_ms"] <= rep["ttft_p99_ms"]
    assert rep["requests_per_s"] > 0 and rep["output_tokens_per_s"] > 0

    # The fault ran: rld0 was SIGKILLed at 2 s and healthy again afterwards, under a new pid.
    kill, restart = rep["faults"]
    assert kill["fault"] == "2:kill=rld0@1" and kill["at_s"] >= 2.0 and kill["note"].startswith("SIGKILL pid ")
    assert restart["at_s"] >= 3.0 and restart["note"].startswith("healthy again")
    rld = rep["rss"]["rld0"]
    assert (rld["kills"], rld["restarts"]) == (1, 1) and str(rld["pid"]) not in kill["note"]
    assert all(r["start_kb"] and r["end_kb"] and r["exit_code"] is None for r in rep["rss"].values())


def test_fault_grammar():
    fs = soak.parse_faults("20:cut=wan, 10:kill=rld0@5,25:heal=wan,30:restart=p0,12:slow=wan@2.5")
    assert [str(f) for f in fs] == ["10:kill=rld0@5", "12:slow=wan@2.5", "20:cut=wan", "25:heal=wan",
                                    "30:restart=p0"]
    assert fs[0] == soak.Fault(10.0, "kill", "rld0", 5.0)
    assert soak.parse_faults("") == []
    for bad in ("kill=rld0", "x:kill=rld0", "5:kill=router", "5:cut=rld0", "5:slow=wan", "5:heal=wan@1",
                "5:restart=md0@2", "-1:cut=wan", "5:explode=wan"):
        with pytest.raises(soak.OptionError, match="--faults"):
            soak.parse_faults(bad)
    assert soak.main(["--embedded", "--faults", "5:cut=wan"]) == 2      # one process: nothing to cut
