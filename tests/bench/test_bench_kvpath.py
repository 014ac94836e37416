"""Smoke test of `python -m pddgw.bench.kvpath`, tiny (no timing assertions).

Pins: the JSON shape; that the production path receives every one-block
chunk straight into the decoder's pool (one copy per byte, all landed) and
the old path copies every byte once more; that both paths leave
byte-identical, non-zero KV in their pools on every transfer (the bench
reads each request's KV back from the pool and compares it exactly); that
the ratios are the ratios of the rates; and that nothing leaks.
"""

from __future__ import annotations

import json

import pytest
from structlog.testing import capture_logs

from pddgw.bench import kvpath

ARGS = ["--json", "--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--block-size", "16",
        "--prompt", "128", "--chunk-kb", "16", "--repeat", "1", "--busy-seqs", "2", "--busy-context", "32"]


def test_kvpath_tiny_json(capsys):
    with capture_logs():                 # the nodes' log lines are not the bench's output
        assert kvpath.main(ARGS) == 0
    rep = json.loads(capsys.readouterr().out)
    c = rep["config"]
    bpt = 2 * 2 * 2 * 16 * 4
    assert (c["kv_bytes_per_token"], c["kv_bytes"], c["prompt_tokens"]) == (bpt, 128 * bpt, 128)
    assert c["frame_bytes"] == 16 * bpt              # one block per frame
    assert rep["raw"]["gb_per_s"] > 0 and rep["raw"]["copies_per_byte"] == 1.0
    digests = set()
    for phase in ("idle", "busy"):
        ph = rep[phase]
        prod, old = ph["production"], ph["old"]
        assert (prod["copies_per_byte"], prod["landed_fraction"]) == (1.0, 1.0)
        assert (old["copies_per_byte"], old["landed_fraction"]) == (2.0, 0.0)
        for x in (prod, old):
            assert x["gb_per_s"] > 0 and x["receive_gb_per_s"] > 0 and x["kv_nonzero"] is True
            assert x["gb_per_s"] == pytest.approx(c["kv_bytes"] / x["seconds_best"] / 1e9)
            digests.add(x["kv_digest"])
        assert ph["production_to_old"] == pytest.approx(prod["gb_per_s"] / old["gb_per_s"])
        assert ph["receive_production_to_old"] == pytest.approx(prod["receive_gb_per_s"] / old["receive_gb_per_s"])
        assert ph["production_to_raw"] == pytest.approx(prod["gb_per_s"] / rep["raw"]["gb_per_s"])
    assert rep["kv_identical"] is True and len(digests) == 1
    assert rep["busy"]["decode_step_ms"] is None or rep["busy"]["decode_step_ms"] > 0
    assert rep["leaks"] == {"d-production": {"used_blocks": 0, "pending": 0},
                            "d-old": {"used_blocks": 0, "pending": 0}}
