"""What the loss of one of a request's nodes means for it: the router's recovery rule.

The router keeps one `Paths` per request in flight: which of its nodes still
serve it, and whose prompt KV is still on its way from P.  When a node fails,
`Paths.lost` marks it lost and answers what to do; the router only carries
the answer out, so the rule is read, and tested, here alone.

The rules, first match wins:
1. MOOT: a node already lost (P reported twice, RLD after MD took over, MD
   after RLD went on alone).
2. MD_FAILS_WITH_P: P lost after RLD had its KV while MD still waited for
   its own: RLD goes on, MD's failure follows (rule 5).
3. REDRIVE: any other loss of P.
4. MD_TAKES_OVER: RLD lost before any handoff, after it emitted tokens, while
   a live MD imports P's KV: MD takes over from the emitted tokens, reusing
   the transfer in flight.
5. RLD_FINISHES: MD lost while RLD is alive and holds or receives the KV
   (`RLD_CAN_FINISH`): RLD finishes alone.
6. REDRIVE: anything else: a new path from the emitted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from pddgw.core.roles import Role
from pddgw.pipeline.state import RLD_HOLDS_KV, RequestState

# Where RLD can finish a request alone: it holds the KV and decodes, or P is still sending
# it the KV (the request moves on to RLD_DECODING first).  Not HANDING_OFF: RLD has stopped
# for the final round (handoff.py) and frees the request once MD extended it.
RLD_CAN_FINISH: frozenset[RequestState] = (
    (RLD_HOLDS_KV - {RequestState.HANDING_OFF}) | {RequestState.PREFILLING})


class Recovery(IntEnum):
    MOOT = 0
    MD_FAILS_WITH_P = 1
    REDRIVE = 2
    MD_TAKES_OVER = 3
    RLD_FINISHES = 4


@dataclass(slots=True)
class Paths:
    """Which of one request's nodes still serve it.  `awaiting_kv`: the decoders (Role.RLD,
    Role.MD) whose prompt KV P has not yet been confirmed to deliver (their first token, or
    MD's Ready); `md_ready`: MD holds the prompt KV; `handoff`: a handoff or takeover runs."""

    has_rld: bool
    has_md: bool
    awaiting_kv: set[Role] = field(default_factory=set)
    p_alive: bool = True
    rld_alive: bool = field(init=False)       # from has_rld / has_md, until lost
    md_alive: bool = field(init=False)
    md_ready: bool = False
    handoff: bool = False

    def __post_init__(self) -> None:
        self.rld_alive, self.md_alive = self.has_rld, self.has_md

    def lost(self, who: Role, state: RequestState, emitted: int) -> Recovery:
        """`who` failed while the request is in `state` with `emitted` tokens out: mark it
        lost and say what recovers the request (the module docstring's rules)."""
        if who == Role.PREFILL:
            if not self.p_alive:
                return Recovery.MOOT
            self.p_alive = False
            if (self.rld_alive and self.md_alive and Role.RLD not in self.awaiting_kv
                    and Role.MD in self.awaiting_kv):
                return Recovery.MD_FAILS_WITH_P
            return Recovery.REDRIVE
        if who == Role.RLD:
            if not self.rld_alive:
                return Recovery.MOOT
            self.rld_alive = False
            if (self.md_alive and not self.handoff and not self.md_ready and emitted > 0
                    and state == RequestState.RLD_DECODING):
                return Recovery.MD_TAKES_OVER
            return Recovery.REDRIVE
        if not self.md_alive:
            return Recovery.MOOT
        self.md_alive = False
        if self.rld_alive and state in RLD_CAN_FINISH:
            return Recovery.RLD_FINISHES
        return Recovery.REDRIVE
