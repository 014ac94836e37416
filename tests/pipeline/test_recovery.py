"""The router's recovery rule (pipeline/recovery.py), row by row, and what each loss marks."""

from __future__ import annotations

import pytest

from pddgw.pipeline.recovery import RLD_CAN_FINISH, Paths, Recovery
from pddgw.pipeline.state import RequestState as S

R = Recovery
ALIVE = {"prefill": "p_alive", "rld": "rld_alive", "md": "md_alive"}


def p_rld_md(awaiting=("rld", "md"), **kw) -> Paths:
    paths = Paths(has_rld=True, has_md=True, awaiting_kv=set(awaiting))
    for k, v in kw.items():
        setattr(paths, k, v)
    return paths


def test_rld_can_finish_where_it_holds_or_receives_the_kv_and_still_decodes():
    assert RLD_CAN_FINISH == {S.PREFILLING, S.RLD_DECODING, S.HANDOFF_PENDING, S.CATCHING_UP}


@pytest.mark.parametrize("paths, who, state, emitted, want", [
    # P lost
    (p_rld_md(awaiting=("md",)), "prefill", S.RLD_DECODING, 3, R.MD_FAILS_WITH_P),
    (p_rld_md(awaiting=("rld", "md")), "prefill", S.PREFILLING, 0, R.REDRIVE),     # RLD lacks its KV too
    (p_rld_md(awaiting=()), "prefill", S.RLD_DECODING, 3, R.REDRIVE),             # MD had its KV already
    (p_rld_md(awaiting=("md",), md_alive=False), "prefill", S.RLD_DECODING, 3, R.REDRIVE),
    (Paths(has_rld=False, has_md=True, awaiting_kv={"md"}), "prefill", S.PREFILLING, 0, R.REDRIVE),
    # RLD lost
    (p_rld_md(awaiting=()), "rld", S.RLD_DECODING, 5, R.MD_TAKES_OVER),
    (p_rld_md(awaiting=(), md_ready=True), "rld", S.RLD_DECODING, 5, R.REDRIVE),   # handoff is next
    (p_rld_md(awaiting=(), handoff=True), "rld", S.RLD_DECODING, 5, R.REDRIVE),
    (p_rld_md(awaiting=()), "rld", S.RLD_DECODING, 0, R.REDRIVE),                  # nothing to take over
    (p_rld_md(awaiting=()), "rld", S.HANDOFF_PENDING, 5, R.REDRIVE),
    (p_rld_md(awaiting=(), md_alive=False), "rld", S.RLD_DECODING, 5, R.REDRIVE),
    (Paths(has_rld=True, has_md=False), "rld", S.RLD_DECODING, 5, R.REDRIVE),      # P-RLD
    # MD lost
    (p_rld_md(), "md", S.PREFILLING, 0, R.RLD_FINISHES),
    (p_rld_md(awaiting=()), "md", S.RLD_DECODING, 4, R.RLD_FINISHES),
    (p_rld_md(awaiting=(), md_ready=True, handoff=True), "md", S.CATCHING_UP, 9, R.RLD_FINISHES),
    (p_rld_md(awaiting=(), md_ready=True, handoff=True), "md", S.HANDING_OFF, 9, R.REDRIVE),  # RLD stopped
    (p_rld_md(awaiting=()), "md", S.MD_DECODING, 20, R.REDRIVE),
    (p_rld_md(awaiting=(), rld_alive=False), "md", S.RLD_DECODING, 4, R.REDRIVE),
    (Paths(has_rld=False, has_md=True), "md", S.MD_DECODING, 4, R.REDRIVE),        # P-MD
])
def test_the_rule(paths, who, state, emitted, want):
    assert paths.lost(who, state, emitted) is want
    assert not getattr(paths, ALIVE[who])


@pytest.mark.parametrize("who, first", [("prefill", R.MD_FAILS_WITH_P), ("rld", R.MD_TAKES_OVER),
                                        ("md", R.RLD_FINISHES)])
def test_a_node_lost_again_is_moot_and_the_others_keep_their_state(who, first):
    state = S.RLD_DECODING
    paths = p_rld_md(awaiting=("md",) if who == "prefill" else ())
    assert paths.lost(who, state, 3) is first
    alive = (paths.p_alive, paths.rld_alive, paths.md_alive)
    assert paths.lost(who, state, 3) is R.MOOT
    assert (paths.p_alive, paths.rld_alive, paths.md_alive) == alive
    assert alive.count(False) == 1


def test_paths_start_with_the_nodes_the_request_has():
    assert (Paths(has_rld=False, has_md=True).rld_alive, Paths(has_rld=False, has_md=True).md_alive) == (False, True)
    assert Paths(has_rld=True, has_md=False).rld_alive and not Paths(has_rld=True, has_md=False).md_alive
