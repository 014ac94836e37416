"""Request state machine: the transition table, typed errors, the timeline record."""

from __future__ import annotations

import itertools

import orjson
import pytest

from pddgw.pipeline.state import (
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    RequestState as S,
    RequestTracker,
)


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def tick(self, ms: float) -> None:
        self.t += ms / 1000.0


# The table, written out independently of the implementation: (src, dst) legal pairs.
_END = {S.FAILED, S.CANCELLED}
EXPECTED = {
    S.RECEIVED: {S.ROUTED} | _END,
    S.ROUTED: {S.PREFILLING} | _END,
    S.PREFILLING: {S.RLD_DECODING, S.MD_DECODING, S.HANDOFF_PENDING, S.REDRIVING} | _END,
    S.RLD_DECODING: {S.RLD_DECODING, S.HANDOFF_PENDING, S.FINISHED, S.REDRIVING} | _END,
    S.HANDOFF_PENDING: {S.CATCHING_UP, S.HANDING_OFF, S.RLD_DECODING, S.FINISHED, S.REDRIVING} | _END,
    S.CATCHING_UP: {S.CATCHING_UP, S.HANDING_OFF, S.RLD_DECODING, S.FINISHED, S.REDRIVING} | _END,
    S.HANDING_OFF: {S.MD_DECODING, S.RLD_DECODING, S.FINISHED, S.REDRIVING} | _END,
    S.MD_DECODING: {S.FINISHED, S.REDRIVING} | _END,
    S.REDRIVING: {S.PREFILLING, S.HANDOFF_PENDING} | _END,
    S.FINISHED: set(),
    S.FAILED: set(),
    S.CANCELLED: set(),
}

# A legal path from RECEIVED to each state.
PATHS = {
    S.RECEIVED: [],
    S.ROUTED: [S.ROUTED],
    S.PREFILLING: [S.ROUTED, S.PREFILLING],
    S.RLD_DECODING: [S.ROUTED, S.PREFILLING, S.RLD_DECODING],
    S.HANDOFF_PENDING: [S.ROUTED, S.PREFILLING, S.RLD_DECODING, S.HANDOFF_PENDING],
    S.CATCHING_UP: [S.ROUTED, S.PREFILLING, S.RLD_DECODING, S.HANDOFF_PENDING, S.CATCHING_UP],
    S.HANDING_OFF: [S.ROUTED, S.PREFILLING, S.RLD_DECODING, S.HANDOFF_PENDING, S.HANDING_OFF],
    S.MD_DECODING: [S.ROUTED, S.PREFILLING, S.MD_DECODING],
    S.REDRIVING: [S.ROUTED, S.PREFILLING, S.REDRIVING],
    S.FINISHED: [S.ROUTED, S.PREFILLING, S.MD_DECODING, S.FINISHED],
    S.FAILED: [S.FAILED],
    S.CANCELLED: [S.CANCELLED],
}


def tracker_in(state: S, clock: FakeClock | None = None) -> RequestTracker:
    tr = RequestTracker("r1", clock=clock or FakeClock())
    for s in PATHS[state]:
        tr.advance(s)
    assert tr.state is state
    return tr


def test_enum_order_and_terminals():
    assert [s.name for s in sorted(S)] == [
        "RECEIVED", "ROUTED", "PREFILLING", "RLD_DECODING", "HANDOFF_PENDING", "CATCHING_UP",
        "HANDING_OFF", "MD_DECODING", "REDRIVING", "FINISHED", "FAILED", "CANCELLED"]
    assert TERMINAL == {S.FINISHED, S.FAILED, S.CANCELLED}
    assert all(t > s for t in TERMINAL for s in S if s not in TERMINAL)


def test_table_is_exactly_the_expected_one():
    assert set(TRANSITIONS) == set(S)
    assert {s: set(d) for s, d in TRANSITIONS.items()} == EXPECTED


@pytest.mark.parametrize("src,dst", list(itertools.product(S, S)),
                         ids=lambda s: s.name)
def test_every_transition(src: S, dst: S):
    tr = tracker_in(src)
    n_stamps = len(tr.record().states)
    if dst in EXPECTED[src]:
        tr.advance(dst, "why")
        assert tr.state is dst
        assert tr.record().states[-1] == (dst.name, 0.0, "why")
    else:
        with pytest.raises(IllegalTransition) as ei:
            tr.advance(dst)
        assert (ei.value.src, ei.value.dst, ei.value.request_id) == (src, dst, "r1")
        assert f"{src.name} -> {dst.name}" in str(ei.value)
        assert tr.state is src
        assert len(tr.record().states) == n_stamps


def test_p_rld_md_catch_up_timeline():
    clk = FakeClock()
    tr = RequestTracker("req-7", clock=clk)
    clk.tick(2)
    tr.route("P-RLD-MD", "transfer_over_budget")
    clk.tick(1)
    tr.advance(S.PREFILLING)
    tr.add_wan_kv_bytes(4096)
    tr.add_wan_kv_bytes(2048)
    clk.tick(10)
    tr.advance(S.RLD_DECODING)
    clk.tick(5)
    tr.tokens_emitted(0, 1, "rld")          # TTFT = 18 ms
    clk.tick(3)
    tr.tokens_emitted(1, 69, "rld")         # t = 21
    clk.tick(4)
    tr.md_ready("md holds prompt KV")       # t = 25
    tr.handoff_round(0, 70, final=False)
    assert tr.state is S.CATCHING_UP and tr.handed_off == 70 and tr.catchup_rounds == 1
    clk.tick(5)
    tr.tokens_emitted(70, 10, "rld")        # t = 30, last RLD token before the final handoff
    tr.handoff_round(70, 80, final=True)
    assert tr.state is S.HANDING_OFF and tr.handed_off == 80
    clk.tick(7)
    tr.advance(S.MD_DECODING)
    tr.tokens_emitted(80, 1, "md")          # t = 37: stall 7 ms
    clk.tick(1)
    tr.tokens_emitted(81, 19, "md")
    tr.finish("eos")
    rec = tr.record()
    assert rec.to_dict() == {
        "request_id": "req-7",
        "pipeline": "P-RLD-MD",
        "planned_pipeline": "P-RLD-MD",
        "route_reason": "transfer_over_budget",
        "final_state": "FINISHED",
        "handoff_mode": "catch-up",
        "handoff_positions": [70, 80],
        "handoff_position": 80,
        "ttft_ms": 18.0,
        "total_ms": 38.0,
        "wan_kv_bytes": 6144,
        "handoff_stall_ms": 7.0,
        "max_itl_ms": 9.0,                  # t = 21 -> 30, ended by position 70
        "max_itl_position": 70,
        "output_tokens": 100,
        "tokens_by_role": {"md": 20, "rld": 80},
        "fallback_reason": None,
        "redrives": [],
        "error": None,
        "states": [
            {"state": "RECEIVED", "t_ms": 0.0, "reason": ""},
            {"state": "ROUTED", "t_ms": 2.0, "reason": "transfer_over_budget"},
            {"state": "PREFILLING", "t_ms": 3.0, "reason": ""},
            {"state": "RLD_DECODING", "t_ms": 13.0, "reason": ""},
            {"state": "HANDOFF_PENDING", "t_ms": 25.0, "reason": "md holds prompt KV"},
            {"state": "CATCHING_UP", "t_ms": 25.0, "reason": "handoff [0, 70)"},
            {"state": "HANDING_OFF", "t_ms": 30.0, "reason": "handoff [70, 80) final"},
            {"state": "MD_DECODING", "t_ms": 37.0, "reason": ""},
            {"state": "FINISHED", "t_ms": 38.0, "reason": "eos"},
        ],
    }
    # Plain JSON all the way down.
    assert orjson.loads(orjson.dumps(rec.to_dict())) == rec.to_dict()
    # The answers' summary leaves the state timeline out unless asked (it grows with the steps).
    assert rec.to_dict(states=False) == {k: v for k, v in rec.to_dict().items() if k != "states"}


def test_p_md_timeline_has_no_handoff():
    clk = FakeClock()
    tr = RequestTracker("a", clock=clk)
    tr.route("P-MD", "fits_budget")
    tr.advance(S.PREFILLING)
    tr.add_wan_kv_bytes(512)
    clk.tick(40)
    tr.advance(S.MD_DECODING)
    clk.tick(2.5)
    tr.tokens_emitted(0, 3, "md")
    tr.finish()
    d = tr.record().to_dict()
    assert (d["pipeline"], d["handoff_mode"], d["handoff_positions"], d["handoff_position"],
            d["handoff_stall_ms"], d["ttft_ms"], d["wan_kv_bytes"], d["tokens_by_role"]) == (
        "P-MD", None, [], None, None, 42.5, 512, {"md": 3})


def test_one_shot_handoff_and_stall():
    clk = FakeClock()
    tr = RequestTracker("b", clock=clk)
    for s in PATHS[S.RLD_DECODING][:-1]:
        tr.advance(s)
    tr.advance(S.RLD_DECODING)
    for i in range(40):
        clk.tick(1)
        tr.tokens_emitted(i, 1, "rld")
    tr.md_ready()
    tr.handoff_round(0, 40, final=True)
    clk.tick(12.25)
    tr.advance(S.MD_DECODING)
    tr.tokens_emitted(40, 2, "md")
    tr.finish()
    r = tr.record()
    assert (r.handoff_mode, r.handoff_positions, r.handoff_position, r.handoff_stall_ms,
            r.ttft_ms) == ("one-shot", (40,), 40, 12.25, 1.0)
    assert dict(r.tokens_by_role) == {"rld": 40, "md": 2}


def test_stall_is_none_when_nothing_crossed_the_handoff():
    tr = RequestTracker("c", clock=FakeClock())
    for s in PATHS[S.HANDOFF_PENDING]:
        tr.advance(s)
    # MD was ready before RLD emitted anything: a zero-token one-shot.
    tr.handoff_round(0, 0, final=True)
    tr.advance(S.MD_DECODING)
    tr.tokens_emitted(0, 5, "md")
    tr.finish()
    r = tr.record()
    assert (r.handoff_mode, r.handoff_positions, r.handoff_stall_ms) == ("one-shot", (0,), None)


def test_handoff_rounds_must_be_contiguous_and_in_a_handoff():
    tr = tracker_in(S.RLD_DECODING)
    with pytest.raises(IllegalTransition):
        tr.handoff_round(0, 10, final=True)
    tr.md_ready()
    with pytest.raises(ValueError, match="does not continue at 0"):
        tr.handoff_round(5, 10, final=False)
    tr.handoff_round(0, 64, final=False)
    with pytest.raises(ValueError, match="does not continue at 64"):
        tr.handoff_round(60, 70, final=False)
    with pytest.raises(ValueError):
        tr.handoff_round(64, 63, final=True)
    tr.handoff_round(64, 100, final=False)
    tr.handoff_round(100, 110, final=True)
    assert tr.record().handoff_positions == (64, 100, 110)
    with pytest.raises(IllegalTransition):
        tr.handoff_round(110, 120, final=True)


@pytest.mark.parametrize("state", [S.RLD_DECODING, S.HANDOFF_PENDING, S.CATCHING_UP, S.HANDING_OFF])
def test_fallback_to_rld_before_handoff_completes(state: S):
    tr = tracker_in(state)
    tr.fall_back_to_rld("wan down")
    assert tr.state is S.RLD_DECODING and tr.pipeline == "P-RLD"
    tr.finish()
    r = tr.record()
    assert (r.pipeline, r.planned_pipeline, r.fallback_reason, r.states[-2]) == (
        "P-RLD", None, "wan down", ("RLD_DECODING", 0.0, "fallback: wan down"))


@pytest.mark.parametrize("state", [S.RECEIVED, S.ROUTED, S.PREFILLING, S.MD_DECODING, S.REDRIVING,
                                   S.FINISHED, S.FAILED, S.CANCELLED])
def test_fallback_impossible_where_rld_lacks_the_kv(state: S):
    tr = tracker_in(state)
    with pytest.raises(IllegalTransition, match="re-drive instead"):
        tr.fall_back_to_rld("md died")
    assert tr.state is state


def test_fallback_relabels_pipeline():
    tr = RequestTracker("d", clock=FakeClock())
    tr.route("P-RLD-MD")
    tr.advance(S.PREFILLING)
    tr.advance(S.RLD_DECODING)
    tr.md_ready()
    tr.handoff_round(0, 64, final=False)
    tr.fall_back_to_rld("md timeout")
    tr.finish()
    r = tr.record()
    assert (r.pipeline, r.planned_pipeline, r.handoff_mode, r.handoff_position) == (
        "P-RLD", "P-RLD-MD", "catch-up", None)


def test_redrive_after_handoff_to_another_md():
    clk = FakeClock()
    tr = RequestTracker("e", clock=clk)
    tr.route("P-MD")
    tr.advance(S.PREFILLING)
    tr.advance(S.MD_DECODING)
    tr.tokens_emitted(0, 30, "md")
    clk.tick(50)
    tr.redrive("md-1 died")
    assert tr.state is S.REDRIVING
    tr.advance(S.PREFILLING, "P resends the prompt KV to md-2")
    tr.md_ready()
    tr.handoff_round(0, 30, final=True)
    tr.advance(S.MD_DECODING)
    tr.tokens_emitted(30, 5, "md")
    tr.finish()
    r = tr.record()
    assert r.redrives == (("md-1 died", 30, 50.0),)
    assert (r.pipeline, r.handoff_mode, r.handoff_position, r.output_tokens) == (
        "P-MD", "one-shot", 30, 35)
    assert [s for s, _, _ in r.states] == [
        "RECEIVED", "ROUTED", "PREFILLING", "MD_DECODING", "REDRIVING", "PREFILLING",
        "HANDOFF_PENDING", "HANDING_OFF", "MD_DECODING", "FINISHED"]


def test_prefill_retry_and_redrive_back_to_rld():
    tr = tracker_in(S.PREFILLING)
    tr.redrive("p-1 refused")
    tr.advance(S.PREFILLING)
    tr.advance(S.RLD_DECODING)
    tr.tokens_emitted(0, 4, "rld")
    tr.redrive("rld-1 died")
    tr.advance(S.PREFILLING)
    tr.advance(S.RLD_DECODING)
    tr.tokens_emitted(4, 4, "rld")
    tr.finish()
    assert [(r, p) for r, p, _ in tr.record().redrives] == [("p-1 refused", 0), ("rld-1 died", 4)]


def test_fail_and_cancel_record_the_reason():
    tr = tracker_in(S.CATCHING_UP)
    tr.fail("no MD and RLD lost")
    r = tr.record()
    assert (r.final_state, r.error, tr.terminal) == (S.FAILED, "no MD and RLD lost", True)
    tr2 = tracker_in(S.PREFILLING)
    tr2.cancel()
    assert (tr2.record().final_state, tr2.record().error) == (S.CANCELLED, "cancelled")
    with pytest.raises(IllegalTransition):
        tr2.finish()


def test_route_checks_pipeline_and_happens_once():
    tr = RequestTracker("f", clock=FakeClock())
    with pytest.raises(ValueError, match="unknown pipeline"):
        tr.route("P-X")  # type: ignore[arg-type]
    assert tr.state is S.RECEIVED
    tr.route("P-RLD", "singular")
    with pytest.raises(IllegalTransition):
        tr.route("P-MD")
    assert tr.record().pipeline == "P-RLD"


def test_tokens_emitted_must_be_in_order():
    tr = tracker_in(S.RLD_DECODING)
    tr.tokens_emitted(0, 2, "rld")
    with pytest.raises(ValueError, match="next position is 2"):
        tr.tokens_emitted(3, 1, "rld")
    with pytest.raises(ValueError):
        tr.tokens_emitted(2, 0, "rld")
    with pytest.raises(ValueError, match="unknown role"):
        tr.tokens_emitted(2, 1, "gpu")  # type: ignore[arg-type]
    tr.finish()
    with pytest.raises(ValueError, match="after FINISHED"):
        tr.tokens_emitted(2, 1, "rld")
    with pytest.raises(ValueError):
        tr.add_wan_kv_bytes(-1)


def test_total_ms_runs_until_terminal():
    clk = FakeClock()
    tr = RequestTracker("g", clock=clk)
    clk.tick(5)
    assert tr.record().total_ms == 5.0
    tr.cancel("client went away")
    clk.tick(100)
    assert tr.record().total_ms == 5.0


def test_stall_counts_rld_tokens_racing_the_handoff():
    """RLD's last piece lands after the final round was recorded."""
    clk = FakeClock()
    tr = tracker_in(S.HANDOFF_PENDING, clk)
    clk.tick(1)
    tr.tokens_emitted(0, 30, "rld")      # t = 1
    clk.tick(4)
    tr.handoff_round(0, 40, final=True)  # t = 5: RLD stopped at 40, [30, 40) still in flight
    clk.tick(9)
    tr.tokens_emitted(30, 10, "rld")     # t = 14: 13 ms after the previous token
    clk.tick(6)
    tr.advance(S.MD_DECODING)
    tr.tokens_emitted(40, 1, "md")       # t = 20: 6 ms later
    assert tr.record().handoff_stall_ms == 13.0
    # Had the late piece arrived with MD's first token, the stall is the whole wait.
    clk2 = FakeClock()
    tr2 = tracker_in(S.HANDOFF_PENDING, clk2)
    tr2.tokens_emitted(0, 30, "rld")
    tr2.handoff_round(0, 40, final=True)
    clk2.tick(21)
    tr2.tokens_emitted(30, 10, "rld")
    tr2.advance(S.MD_DECODING)
    tr2.tokens_emitted(40, 1, "md")
    assert tr2.record().handoff_stall_ms == 21.0


def test_a_request_md_starves_after_the_handoff_shows_it_in_its_timeline():
    """Issue 23's case: one-shot at position 3, MD's first token 37 ms after RLD's last,
    then 66 s until the next one (MD preempted behind long requests)."""
    clk = FakeClock()
    tr = tracker_in(S.RLD_DECODING, clk)
    clk.tick(5)
    tr.tokens_emitted(0, 1, "rld")          # t = 5
    clk.tick(2)
    tr.tokens_emitted(1, 2, "rld")          # t = 7: RLD's last tokens
    tr.md_ready(held=1)
    clk.tick(10)
    tr.handoff_round(1, 3, final=True)      # t = 17
    clk.tick(27)
    tr.advance(S.MD_DECODING)
    tr.tokens_emitted(3, 1, "md")           # t = 44: 37 ms after position 2
    clk.tick(66_000)
    tr.tokens_emitted(4, 1, "md")           # 66 s later
    for i in range(5, 24):
        clk.tick(20)
        tr.tokens_emitted(i, 1, "md")
    tr.finish("length")
    d = tr.record().to_dict()
    assert (d["handoff_mode"], d["handoff_position"], d["handoff_stall_ms"], d["max_itl_ms"],
            d["max_itl_position"], d["output_tokens"]) == ("one-shot", 3, 37.0, 66_000.0, 4, 24)


def test_stall_runs_to_mds_first_token_not_to_the_handoff_ack():
    """MD's first token after the handoff comes 66 s after RLD's last: that is the stall,
    however early the handoff itself was recorded and acknowledged."""
    clk = FakeClock()
    tr = tracker_in(S.RLD_DECODING, clk)
    tr.tokens_emitted(0, 3, "rld")          # t = 0
    tr.md_ready(held=1)
    clk.tick(30)
    tr.handoff_round(1, 3, final=True)      # t = 30 (RLD's ack would follow at once)
    clk.tick(7)
    tr.advance(S.MD_DECODING)               # MD's stream opened: still no token
    clk.tick(66_000 - 37)
    tr.tokens_emitted(3, 2, "md")           # t = 66 000
    clk.tick(4)
    tr.tokens_emitted(5, 1, "md")
    r = tr.record()
    assert (r.handoff_stall_ms, r.max_itl_ms, r.max_itl_position) == (66_000.0, 66_000.0, 3)


def test_max_itl_needs_two_emissions_and_names_the_first_of_equal_gaps():
    clk = FakeClock()
    tr = tracker_in(S.MD_DECODING, clk)
    assert (tr.record().max_itl_ms, tr.record().max_itl_position) == (None, None)
    clk.tick(500)                            # TTFT is not an inter-token gap
    tr.tokens_emitted(0, 4, "md")
    assert (tr.record().max_itl_ms, tr.record().max_itl_position) == (None, None)
    for pos, ms in ((4, 3), (5, 8), (7, 8), (9, 2)):
        clk.tick(ms)
        tr.tokens_emitted(pos, 2 if pos in (5, 7) else 1, "md")
    assert (tr.record().max_itl_ms, tr.record().max_itl_position) == (8.0, 5)


def test_stall_none_when_one_piece_crosses_the_handoff():
    tr = tracker_in(S.HANDOFF_PENDING)
    tr.tokens_emitted(0, 5, "rld")
    tr.handoff_round(0, 10, final=True)
    tr.tokens_emitted(5, 10, "rld")  # cannot happen with a correct RLD; no gap to report
    assert tr.record().handoff_stall_ms is None
