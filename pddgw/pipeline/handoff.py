"""The token-ID handoff RLD -> MD, both sides: one-shot and catch-up.

Router side (`drive_handoff`), once MD reports the prompt KV in:
  1. pick the mode from the loads (`policy.choose_handoff_mode`);
  2. send RLD a `HandOff` naming MD, the mode, the catch-up bounds and the
     router's WAN RTT estimate, and wait for `HandedOff` (MD's position).
RLD side (`relay_handoff`), between two decode steps:
  1. plan a round (`policy.plan_handoff_round`) from the tokens generated,
     the tokens sent, and RLD's tokens per round trip: before the first
     round (RTT + one MD extend step) / RLD's measured decode step, then
     what RLD actually made during the previous round;
  2. a non-final round: tell the router (its timeline), send the chunk
     to MD as an `Extend` and wait for MD's ack (MD extended it), while RLD
     keeps decoding and streaming; go to 1;
  3. the final round: RLD stops, emits every token it made, sends MD the
     rest with final=True and frees the request; MD samples from there.
So catch-up converges in two rounds whenever RLD makes fewer than the
threshold tokens per round trip, and when it makes more (a slow WAN next to
a fast relay) the plan goes one-shot at once instead of chasing.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

import structlog

from pddgw.config import PolicyConfig
from pddgw.net.errors import RemoteError
from pddgw.net.link import Link
from pddgw import messages as m
from pddgw.pipeline.decode import DecodeWorker
from pddgw.pipeline.policy import HandoffInputs, choose_handoff_mode, plan_handoff_round
from pddgw.pipeline.state import HandoffMode

log = structlog.get_logger(__name__)


# ---- router side ------------------------------------------------------------------------
async def drive_handoff(rid: str, rld: Link, md_name: str, policy: PolicyConfig, generated: int,
                        rld_load: float, md_load: float, rtt_ms: float, timeout: float,
                        force_mode: HandoffMode | None = None) -> m.HandedOff | None:
    """Steps 1-2 of the router side -> RLD's HandedOff, or None when RLD had
    nothing left to hand off (it finished first: RLD refuses with code "request").
    Any other failure propagates: a round MD did not take may have frozen RLD,
    so the request must be re-driven, not left waiting for tokens."""
    if force_mode:
        policy = dataclasses.replace(policy, handoff_mode=force_mode)
    decision = choose_handoff_mode(HandoffInputs(generated, rld_load, md_load), policy)
    log.info("handoff_decision", request_id=rid, **decision.as_log())
    msg = m.HandOff(rid, md_name, decision.mode, decision.threshold,
                     max(policy.catchup_max_chunk, decision.threshold), policy.catchup_max_rounds,
                     round(rtt_ms, 3), decision.reason == "forced")
    try:
        reply = await rld.request(msg, timeout=timeout)
    except RemoteError as e:
        if e.code != "request":
            raise
        log.info("handoff_skipped", request_id=rid, reason=str(e))
        return None
    assert isinstance(reply, m.HandedOff), reply
    return reply


# ---- RLD side ------------------------------------------------------------------------------
SendRound = Callable[[int, tuple[int, ...], bool], Awaitable[None]]


def round_sender(rid: str, router: Link, md: Link) -> SendRound:
    """Step 2's send: (start, ids, final) -> the router hears of the round, MD extends it."""

    async def send(start: int, ids: tuple[int, ...], final: bool) -> None:
        # The router hears of the round before MD can emit anything after it.
        await router.send(m.HandoffRound(rid, start, start + len(ids), final))
        await md.request(m.Extend(rid, start, final, ids))

    return send


async def relay_handoff(dec: DecodeWorker, msg: m.HandOff, send: SendRound) -> m.HandedOff:
    """Steps 1-3 of the RLD side; -> the position MD continues from.

    `send(start, ids, final)` returns once MD has extended the round.  Output
    position 0 (P's token) is already on MD, so rounds start at 1.
    """
    rid = msg.request_id
    loop = asyncio.get_running_loop()
    s = await dec.begin_handoff(rid)
    step_s = dec.step_seconds(rid)
    # Before any round: one WAN round trip plus MD's extend step, in RLD's steps.
    per_round = (msg.rtt_ms / 1e3 + step_s) / step_s if step_s > 0 else 0.0
    sent, rounds = 1, 0
    while True:
        chunk = plan_handoff_round(generated=len(s.tokens), sent=sent, rounds_done=rounds, mode=msg.mode,
                                   threshold=msg.threshold, max_chunk=msg.max_chunk,
                                   max_rounds=msg.max_rounds, per_round=per_round, forced=msg.forced)
        log.debug("handoff_round", request_id=rid, **chunk.as_log())
        if chunk.final:
            end = await dec.freeze(rid)
            await send(sent, tuple(s.tokens[sent:end]), True)
            await dec.close(rid)
            return m.HandedOff(rid, end)
        before, t0 = len(s.tokens), loop.time()
        await send(sent, tuple(s.tokens[sent:chunk.end]), False)
        per_round = float(len(s.tokens) - before)      # measured: what RLD made meanwhile
        log.debug("handoff_round_acked", request_id=rid, seconds=round(loop.time() - t0, 4),
                  made=per_round)
        sent, rounds = chunk.end, rounds + 1
