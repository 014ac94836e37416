"""`python -m pddgw.bench.relay`: a relaying P's TPOT and prefill rate per `mixed_step_tokens`."""

from __future__ import annotations

import orjson
import pytest

from pddgw.bench import relay

ARGS = ["--caps", "0,64", "--chunk", "256", "--prompt", "512", "--prefills", "1", "--profile", "llama3-8b",
        "--model-prompt", "1024", "--dp", "1", "--repeat", "1"]


def test_both_engines_make_the_same_steps_and_the_cap_shortens_the_modeled_tpot(capsys):
    assert relay.main([*ARGS, "--json"]) == 0
    rows = orjson.loads(capsys.readouterr().out)["rows"]
    got = [(r["engine"].split(" ")[0], r["cap"], r["steps"], r["decoded"]) for r in rows]
    # Uncapped: chunks of 255 tokens beside each decode (1,024 modeled prompt tokens: 5 steps; 512
    # real: 3); capped: 64 a step (16 steps).  Real's capped 512 tokens: 8.
    assert got == [("llama3-8b", 0, 5, 5), ("llama3-8b", 64, 16, 16), ("torch,", 0, 3, 3), ("torch,", 64, 8, 8)]
    modeled = rows[:2]
    assert modeled[1]["tpot_ms"] < modeled[0]["tpot_ms"] and modeled[1]["tpot_ratio"] < 1.0
    assert modeled[0]["tpot_ratio"] == modeled[0]["prefill_ratio"] == 1.0


def test_a_model_that_does_not_fit_is_one_line(capsys):
    with pytest.raises(SystemExit) as ei:
        relay.main([*ARGS[:-6], "--profile", "deepseek-v4-pro", "--dp", "1", "--no-real"])
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m pddgw.bench.relay: error: engine.costmodel: deepseek-v4-pro weights")
