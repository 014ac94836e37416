"""`python -m pddgw.bench.simspeed`: variants side by side, their results compared bit for bit."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from pddgw.bench import simspeed

ROOT = Path(__file__).parent.parent.parent


def test_simspeed_runs_every_variant_and_finds_their_results_identical(capsys):
    # --against this very tree: three variants, one baseline, the same requests from each.
    assert simspeed.main(["--requests", "2", "--cases", "paper", "--against", str(ROOT), "--root", str(ROOT),
                          "--calls", "--json"]) == 0
    rep = orjson.loads(capsys.readouterr().out)
    assert rep["requests"] == 2 and rep["baseline"] == f"against {ROOT}"
    (case,) = rep["cases"]
    assert case["case"] == "paper" and case["deployment"] == "pdd"
    names = [c["variant"] for c in case["cells"]]
    assert names == ["lean loop", "stock loop", f"against {ROOT}"]
    for c in case["cells"]:
        assert c["requests"] == 2 and c["same_results"] is True
        # The rate is computed from the unrounded CPU time; both are then rounded (3 and 2 decimals).
        assert c["cpu_s"] > 0 and c["requests_per_cpu_s"] == pytest.approx(2 / c["cpu_s"], rel=0.01)
        assert c["calls"] > 0
    base = case["cells"][2]
    assert base["speedup"] is None and base["calls_ratio"] is None
    # The stock loop and the baseline (this tree's default loop) run the same Python, call for call,
    # but for the loop's own iteration: the lean loop's is one function, the stock one's more.
    lean, stock = case["cells"][0], case["cells"][1]
    assert lean["calls"] == base["calls"] and stock["calls"] > lean["calls"]


def test_simspeed_refuses_unknown_cases_and_a_tree_without_pddgw(tmp_path, capsys):
    with pytest.raises(SystemExit):
        simspeed.main(["--cases", "paper,nope"])
    assert "--cases: unknown nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simspeed.main(["--against", str(tmp_path)])
    assert "no pddgw package there" in capsys.readouterr().err
