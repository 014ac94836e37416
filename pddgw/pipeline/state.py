"""Per-request state machine on the router, and the timeline it reports.

One `RequestTracker` per request lives on the router's event loop.  Every
state change goes through `TRANSITIONS` (anything else is an
`IllegalTransition`, a router bug) and is timestamped with an injectable
monotonic clock; the resulting `RequestRecord` is what `response.completed`
reports under `"pddgw"` (pipeline, handoff mode and positions, TTFT, WAN KV
bytes, handoff stall, largest inter-token gap, states with timestamps).

Invariants:
  * every gap is measured between emissions to the client: the handoff stall
    ends at MD's first token after the handoff, not at its ack;
  * the `RequestState` order is the order of progress along the happy paths;
    REDRIVING comes after the decode states (entered from any of them, and
    leaving it moves backwards), the three terminal states are the largest;
  * FAILED and CANCELLED are reachable from every non-terminal state;
    terminal states have no exit.

The request's lifecycle and its failure re-drives: docs/architecture.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Literal

# Which node produced a token (the delta's `"pddgw": {"role": ...}`); re-exported for the pipeline.
from pddgw.core.roles import PIPELINES, ROLES, Pipeline, Role

HandoffMode = Literal["one-shot", "catch-up"]


class RequestState(IntEnum):
    RECEIVED = 0
    ROUTED = 1
    PREFILLING = 2
    RLD_DECODING = 3
    HANDOFF_PENDING = 4
    CATCHING_UP = 5
    HANDING_OFF = 6
    MD_DECODING = 7
    REDRIVING = 8
    FINISHED = 9
    FAILED = 10
    CANCELLED = 11


S = RequestState
TERMINAL: frozenset[RequestState] = frozenset({S.FINISHED, S.FAILED, S.CANCELLED})
_ENDS = {S.FAILED, S.CANCELLED}

# Legal transitions: state -> states it may move to.  FAILED and CANCELLED are
# reachable from every non-terminal state; terminal states have no exit.
TRANSITIONS: Mapping[RequestState, frozenset[RequestState]] = {
    S.RECEIVED: frozenset({S.ROUTED} | _ENDS),
    S.ROUTED: frozenset({S.PREFILLING} | _ENDS),
    # MD_DECODING: P-MD.  RLD_DECODING: P-RLD-MD, P-RLD, or a re-drive back to
    # an RLD.  HANDOFF_PENDING: a re-drive whose new MD got the prompt KV and
    # now needs the emitted tokens.  REDRIVING: P (or P-MD's MD) died.
    S.PREFILLING: frozenset({S.RLD_DECODING, S.MD_DECODING, S.HANDOFF_PENDING, S.REDRIVING} | _ENDS),
    # RLD_DECODING -> RLD_DECODING is a fallback (MD lost, RLD keeps going).
    S.RLD_DECODING: frozenset({S.RLD_DECODING, S.HANDOFF_PENDING, S.FINISHED, S.REDRIVING} | _ENDS),
    S.HANDOFF_PENDING: frozenset(
        {S.CATCHING_UP, S.HANDING_OFF, S.RLD_DECODING, S.FINISHED, S.REDRIVING} | _ENDS),
    S.CATCHING_UP: frozenset(
        {S.CATCHING_UP, S.HANDING_OFF, S.RLD_DECODING, S.FINISHED, S.REDRIVING} | _ENDS),
    # FINISHED straight from HANDING_OFF: the handed-off tokens already reach
    # the end (max_output_tokens), MD has nothing left to decode.
    S.HANDING_OFF: frozenset({S.MD_DECODING, S.RLD_DECODING, S.FINISHED, S.REDRIVING} | _ENDS),
    S.MD_DECODING: frozenset({S.FINISHED, S.REDRIVING} | _ENDS),
    S.REDRIVING: frozenset({S.PREFILLING, S.HANDOFF_PENDING} | _ENDS),
    S.FINISHED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}

# States in which RLD still holds the request's KV, so it can finish alone.
RLD_HOLDS_KV: frozenset[RequestState] = frozenset(
    {S.RLD_DECODING, S.HANDOFF_PENDING, S.CATCHING_UP, S.HANDING_OFF})


class IllegalTransition(RuntimeError):
    """A state change the transition table forbids (a router bug)."""

    def __init__(self, request_id: str, src: RequestState, dst: RequestState, why: str = "") -> None:
        self.request_id = request_id
        self.src = src
        self.dst = dst
        self.why = why
        detail = f": {why}" if why else ""
        super().__init__(f"request {request_id}: illegal transition {src.name} -> {dst.name}{detail}")

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        # Crosses process boundaries intact (the simulator runs jobs in worker processes).
        return (IllegalTransition, (self.request_id, self.src, self.dst, self.why))


@dataclass(frozen=True, slots=True)
class StateStamp:
    """Entry into `state` at monotonic time `t` (seconds)."""

    state: RequestState
    t: float
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """A handoff round as the timeline records it: output positions [start, end) handed to MD by
    token ID, at `t` (RLD reports it with `protocol.HandoffRound`; this is what the router keeps)."""

    start: int
    end: int
    final: bool
    t: float


@dataclass(frozen=True, slots=True)
class Emission:
    """`count` output tokens from position `position` sent to the client."""

    position: int
    count: int
    role: Role
    t: float


@dataclass(frozen=True, slots=True)
class Redrive:
    reason: str
    # Output tokens already emitted when the re-drive began.
    position: int
    t: float


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """Frozen summary of one request's timeline; `to_dict` is the JSON form.

    Times are milliseconds since the request was received.
    """

    request_id: str
    # The path actually taken ("P-RLD" after a fallback); None if never routed.
    pipeline: Pipeline | None
    planned_pipeline: Pipeline | None
    route_reason: str
    final_state: RequestState
    handoff_mode: HandoffMode | None
    # End of every handoff round, in order (catch-up rounds then the final one).
    handoff_positions: tuple[int, ...]
    # First output position MD generated itself (end of the last final round).
    handoff_position: int | None
    ttft_ms: float | None
    total_ms: float
    # KV bytes P reported sent over the WAN before the request ended.  When RLD finishes
    # first, P's report may come later: it counts in the router's wan_kv_bytes metric only.
    wan_kv_bytes: int
    handoff_stall_ms: float | None
    # Largest gap between two emissions (after the first token) and the first position after it.
    max_itl_ms: float | None
    max_itl_position: int | None
    output_tokens: int
    tokens_by_role: tuple[tuple[Role, int], ...]
    fallback_reason: str | None
    redrives: tuple[tuple[str, int, float], ...]  # (reason, position, t_ms)
    error: str | None
    states: tuple[tuple[str, float, str], ...]  # (state name, t_ms, reason)

    def to_dict(self, *, states: bool = True) -> dict[str, Any]:
        """`states`: with the state timeline, which grows with the request's steps (the front
        door's answers carry it only when the request asks, `pddgw.states`)."""
        d: dict[str, Any] = {
            "request_id": self.request_id,
            "pipeline": self.pipeline,
            "planned_pipeline": self.planned_pipeline,
            "route_reason": self.route_reason,
            "final_state": self.final_state.name,
            "handoff_mode": self.handoff_mode,
            "handoff_positions": list(self.handoff_positions),
            "handoff_position": self.handoff_position,
            "ttft_ms": self.ttft_ms,
            "total_ms": self.total_ms,
            "wan_kv_bytes": self.wan_kv_bytes,
            "handoff_stall_ms": self.handoff_stall_ms,
            "max_itl_ms": self.max_itl_ms,
            "max_itl_position": self.max_itl_position,
            "output_tokens": self.output_tokens,
            "tokens_by_role": {str(r): n for r, n in self.tokens_by_role},
            "fallback_reason": self.fallback_reason,
            "redrives": [{"reason": r, "position": p, "t_ms": t} for r, p, t in self.redrives],
            "error": self.error,
        }
        if states:
            d["states"] = [{"state": s, "t_ms": t, "reason": r} for s, t, r in self.states]
        return d


class RequestTracker:
    """The router's state machine for one request (single event loop, no locks).

    Every method that changes state validates it against `TRANSITIONS` and
    raises `IllegalTransition` without changing anything when it is not legal.
    Prefer the named steps (`route`, `md_ready`, `handoff_round`,
    `fall_back_to_rld`, `redrive`, `finish`, `fail`, `cancel`): they also
    record what the timeline reports; `advance` records only the stamp (use
    it for PREFILLING, RLD_DECODING and MD_DECODING).
    """

    def __init__(self, request_id: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.request_id = request_id
        self._clock = clock
        self._t0 = clock()
        self._stamps: list[StateStamp] = [StateStamp(S.RECEIVED, self._t0, "")]
        self._planned: Pipeline | None = None
        self._pipeline: Pipeline | None = None
        self._route_reason = ""
        self._rounds: list[RoundRecord] = []
        # Rounds of the handoff episode in progress (since the last md_ready).
        self._episode: list[RoundRecord] = []
        # Output positions MD held when the episode began (P's first token: 1).
        self._episode_base = 0
        self._emissions: list[Emission] = []
        self._emitted = 0
        self._wan_kv_bytes = 0
        self._fallback: str | None = None
        self._redrives: list[Redrive] = []
        self._error: str | None = None

    # ------------------------------------------------------------------ query

    @property
    def state(self) -> RequestState:
        return self._stamps[-1].state

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def pipeline(self) -> Pipeline | None:
        return self._pipeline

    @property
    def emitted(self) -> int:
        """Output tokens sent to the client so far (the next position)."""
        return self._emitted

    @property
    def t0(self) -> float:
        """When the request was received (the clock's time)."""
        return self._t0

    @property
    def last_emission_t(self) -> float | None:
        """When the latest run of tokens was sent to the client (None: none yet)."""
        return self._emissions[-1].t if self._emissions else None

    @property
    def handed_off(self) -> int:
        """Output positions MD holds in the current handoff episode."""
        return self._episode[-1].end if self._episode else self._episode_base

    @property
    def catchup_rounds(self) -> int:
        """Non-final rounds in the current handoff episode."""
        return sum(1 for r in self._episode if not r.final)

    def can_advance(self, dst: RequestState) -> bool:
        return dst in TRANSITIONS[self.state]

    # ------------------------------------------------------------ transitions

    def advance(self, dst: RequestState, reason: str = "") -> None:
        """Move to `dst`; raise IllegalTransition if the table forbids it."""
        if dst not in TRANSITIONS[self.state]:
            raise IllegalTransition(self.request_id, self.state, dst)
        self._stamps.append(StateStamp(dst, self._clock(), reason))

    def route(self, pipeline: Pipeline, reason: str = "") -> None:
        """Step 2: the policy's choice (RECEIVED -> ROUTED)."""
        if pipeline not in PIPELINES:
            raise ValueError(f"unknown pipeline {pipeline!r}")
        self.advance(S.ROUTED, reason)
        self._planned = self._pipeline = pipeline
        self._route_reason = reason

    def md_ready(self, reason: str = "", held: int = 0) -> None:
        """Step 5: MD holds the prompt KV (and the first `held` output positions,
        e.g. P's first token); a new handoff episode begins."""
        self.advance(S.HANDOFF_PENDING, reason)
        self._episode = []
        self._episode_base = held

    def handoff_round(self, start: int, end: int, final: bool) -> None:
        """Step 6: positions [start, end) go to MD by token ID.

        Rounds of one episode are contiguous; a non-final round enters (or
        stays in) CATCHING_UP, the final one enters HANDING_OFF.
        """
        dst = S.HANDING_OFF if final else S.CATCHING_UP
        if self.state not in (S.HANDOFF_PENDING, S.CATCHING_UP):
            raise IllegalTransition(self.request_id, self.state, dst, "no handoff in progress")
        expect = self.handed_off
        if start != expect or end < start:
            raise ValueError(
                f"request {self.request_id}: handoff round [{start}, {end}) does not continue at {expect}")
        self.advance(dst, f"handoff [{start}, {end})" + (" final" if final else ""))
        r = RoundRecord(start, end, final, self._stamps[-1].t)
        self._episode.append(r)
        self._rounds.append(r)

    def fall_back_to_rld(self, reason: str) -> None:
        """MD or the WAN failed before the handoff completed: RLD finishes."""
        if self.state not in RLD_HOLDS_KV:
            raise IllegalTransition(self.request_id, self.state, S.RLD_DECODING,
                                    "RLD no longer holds the KV; re-drive instead")
        self.advance(S.RLD_DECODING, f"fallback: {reason}")
        self._fallback = reason
        self._pipeline = Pipeline.P_RLD
        self._episode = []

    def redrive(self, reason: str) -> None:
        """A node on the path died; a new path starts from the emitted tokens."""
        self.advance(S.REDRIVING, reason)
        self._redrives.append(Redrive(reason, self._emitted, self._stamps[-1].t))
        self._episode = []

    def finish(self, reason: str = "") -> None:
        self.advance(S.FINISHED, reason)

    def fail(self, reason: str) -> None:
        self.advance(S.FAILED, reason)
        self._error = reason

    def cancel(self, reason: str = "cancelled") -> None:
        self.advance(S.CANCELLED, reason)
        self._error = reason

    # ---------------------------------------------------------------- events

    def tokens_emitted(self, position: int, count: int, role: Role) -> float:
        """Output tokens sent to the client, in order (the merger's output); -> the time it
        records for them (`last_emission_t` from now on)."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        if position != self._emitted or count < 1:
            raise ValueError(
                f"request {self.request_id}: emitted [{position}, {position + count}) "
                f"but next position is {self._emitted}")
        if self._stamps[-1].state in TERMINAL:       # `terminal`, read once per run of tokens
            raise ValueError(f"request {self.request_id}: tokens emitted after {self.state.name}")
        t = self._clock()
        self._emissions.append(Emission(position, count, role, t))
        self._emitted += count
        return t

    def add_wan_kv_bytes(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        self._wan_kv_bytes += nbytes

    # ---------------------------------------------------------------- record

    def _handoff_stall(self, final: RoundRecord) -> float | None:
        """The longest wait the client saw across the final handoff.

        The window runs from the last emission made before the final round
        was recorded to the first emission at the handoff position; RLD's
        last tokens may land inside it (they race the handoff message), so
        the stall is the largest gap between consecutive emissions there.
        """
        em = self._emissions
        cover = next((i for i, e in enumerate(em)
                      if e.position <= final.end < e.position + e.count), None)
        # No token at the handoff position yet, or one source emitted across
        # it in one piece (no handoff gap exists).
        if cover is None or em[cover].position != final.end or cover == 0:
            return None
        first = 0
        for i in range(cover):
            if em[i].t <= final.t:
                first = i
        return _ms(max(em[i + 1].t - em[i].t for i in range(first, cover)))

    def _max_itl(self) -> tuple[float | None, int | None]:
        """-> (longest gap between consecutive emissions in ms, the position emitted after it);
        (None, None) before a second emission.  The earliest of equal gaps is named."""
        em = self._emissions
        best = max(range(1, len(em)), key=lambda i: em[i].t - em[i - 1].t, default=None)
        if best is None:
            return None, None
        return _ms(em[best].t - em[best - 1].t), em[best].position

    def record(self) -> RequestRecord:
        t0 = self._t0
        max_itl_ms, max_itl_position = self._max_itl()
        final_rounds = [r for r in self._rounds if r.final]
        position = final_rounds[-1].end if final_rounds else None
        if not self._rounds:
            mode: HandoffMode | None = None
        elif any(not r.final for r in self._rounds):
            mode = "catch-up"
        else:
            mode = "one-shot"
        by_role: dict[Role, int] = {}
        for e in self._emissions:
            by_role[e.role] = by_role.get(e.role, 0) + e.count
        end_t = self._stamps[-1].t if self.terminal else self._clock()
        return RequestRecord(
            request_id=self.request_id,
            pipeline=self._pipeline,
            planned_pipeline=self._planned,
            route_reason=self._route_reason,
            final_state=self.state,
            handoff_mode=mode,
            handoff_positions=tuple(r.end for r in self._rounds),
            handoff_position=position,
            ttft_ms=_ms(self._emissions[0].t - t0) if self._emissions else None,
            total_ms=_ms(end_t - t0),
            wan_kv_bytes=self._wan_kv_bytes,
            handoff_stall_ms=self._handoff_stall(final_rounds[-1]) if final_rounds else None,
            max_itl_ms=max_itl_ms,
            max_itl_position=max_itl_position,
            output_tokens=self._emitted,
            tokens_by_role=tuple(sorted(by_role.items())),
            fallback_reason=self._fallback,
            redrives=tuple((r.reason, r.position, _ms(r.t - t0)) for r in self._redrives),
            error=self._error,
            states=tuple((s.state.name, _ms(s.t - t0), s.reason) for s in self._stamps),
        )
