"""What the router's stream loop consumes: one typed event per thing that happened.

The pumps of a request (P's Prefill reply, each decoder's token stream, the
handoff) turn what they get into these at the edge - a decoder's stream
messages through `StreamReader` (which turns each wire TokenItem, joined
with the Logprobs pieces sent right before it and checked, into the
`TokenRun` the router merges), replies and link failures directly - so the
loop in request_driver.py matches on meaning, not on wire types.  `node` is the
router's handle of the node it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pddgw.core.roles import Role
from pddgw.core.tokens import TokenLogprobs, TokenRun
from pddgw import messages as m


@dataclass(frozen=True, slots=True)
class FromNode:
    """Something that happened at `node` (the router's handle of the node it came from)."""

    node: Any


@dataclass(frozen=True, slots=True)
class Tokens(FromNode):
    """Output tokens from a decoder (position-keyed, its role named; `run.done` ends its stream)."""

    run: TokenRun


@dataclass(frozen=True, slots=True)
class PrefillFinished(FromNode):
    """P computed the prompt and served every target (or reports which failed)."""

    done: m.PrefillDone


@dataclass(frozen=True, slots=True)
class KvReady(FromNode):
    """A holding decoder (MD in P-RLD-MD) has the whole prompt KV."""


@dataclass(frozen=True, slots=True)
class RoundSent(FromNode):
    """RLD sent MD a handoff round."""

    round: m.HandoffRound


@dataclass(frozen=True, slots=True)
class HandoffEnded(FromNode):
    """RLD's handoff finished (`handed` = MD's position) or had nothing to hand off (None)."""

    handed: m.HandedOff | None


@dataclass(frozen=True, slots=True)
class NodeFailed(FromNode):
    """A node, its link or one of its operations for this request failed."""

    why: str


Event = Tokens | PrefillFinished | KvReady | RoundSent | HandoffEnded | NodeFailed


class StreamError(ValueError):
    """A decoder's stream broke the protocol (e.g. logprobs that do not match their tokens)."""


class StreamReader:
    """One decoder's stream of one request -> events (`event`); its tokens' runs name `role`.

    `top_n`: None when the request asked for no logprobs; else the number of
    alternatives every position must carry.  Then each TokenItem with tokens
    must come right after Logprobs pieces covering exactly its positions, in
    order; without it none may come.  Anything else raises StreamError (the
    pump turns it into `NodeFailed`).
    """

    def __init__(self, node: Any, role: Role, top_n: int | None = None):
        self.node = node
        self.role = role
        self.top_n = top_n
        self._pieces: list[m.Logprobs] = []

    def event(self, msg: m.Message) -> Event | None:
        """A stream message -> its event (None: nothing the loop acts on).

        A stream raises on an `Error` (the pump turns it into `NodeFailed`)."""
        match msg:
            case m.Logprobs():
                if self.top_n is None:
                    raise StreamError(f"request {msg.request_id}: logprobs nobody asked for")
                if msg.top_n != self.top_n:
                    raise StreamError(f"request {msg.request_id}: {msg.top_n} alternatives per position, "
                                      f"asked for {self.top_n}")
                self._pieces.append(msg)
                return None
            case m.TokenItem():
                # The one place a wire item becomes a run (a decoder's node builds the item, `node._item`).
                return Tokens(self.node, TokenRun(msg.request_id, msg.position, msg.ids, msg.done, msg.reason,
                                                  self._join(msg), self.role))
            case m.Ready():
                return KvReady(self.node)
            case m.HandoffRound():
                return RoundSent(self.node, msg)
        return None

    def _join(self, item: m.TokenItem) -> tuple[TokenLogprobs, ...]:
        pieces, self._pieces = self._pieces, []
        if self.top_n is None or not item.ids:
            if pieces:
                raise StreamError(f"request {item.request_id}: logprobs without tokens")
            return ()
        out: list[TokenLogprobs] = []
        for p in pieces:
            if p.position != item.position + len(out):
                raise StreamError(f"request {item.request_id}: logprobs for position {p.position}, expected "
                                  f"{item.position + len(out)}")
            out += p.entries()
        if len(out) != len(item.ids):
            raise StreamError(f"request {item.request_id}: {len(out)} logprobs for {len(item.ids)} tokens at "
                              f"position {item.position}")
        return tuple(out)

