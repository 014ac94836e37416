"""What the router's stream loop consumes: one typed event per thing that happened.

The pumps of a request (P's Prefill reply, each decoder's token stream, the
handoff) turn what they get into these at the edge - a decoder's stream
messages through `from_message`, replies and link failures directly - so the
loop in router.py matches on meaning, not on wire types.  `node` is the
router's handle of the node it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pddgw.net import messages as m
from pddgw.pipeline import protocol as pm


@dataclass(frozen=True, slots=True)
class Tokens:
    """Output tokens from a decoder (position-keyed; `item.done` ends its stream)."""

    node: Any
    item: m.TokenItem


@dataclass(frozen=True, slots=True)
class PrefillFinished:
    """P computed the prompt and served every target (or reports which failed)."""

    node: Any
    done: pm.PrefillDone


@dataclass(frozen=True, slots=True)
class KvReady:
    """A holding decoder (MD in P-RLD-MD) has the whole prompt KV."""

    node: Any


@dataclass(frozen=True, slots=True)
class RoundSent:
    """RLD sent MD a handoff round."""

    node: Any
    round: pm.HandoffRound


@dataclass(frozen=True, slots=True)
class HandoffEnded:
    """RLD's handoff finished (`handed` = MD's position) or had nothing to hand off (None)."""

    node: Any
    handed: pm.HandedOff | None


@dataclass(frozen=True, slots=True)
class NodeFailed:
    """A node, its link or one of its operations for this request failed."""

    node: Any
    why: str


Event = Tokens | PrefillFinished | KvReady | RoundSent | HandoffEnded | NodeFailed


def from_message(node: Any, msg: m.Message) -> Event | None:
    """A decoder's stream message -> its event (None: nothing the loop acts on).

    A stream raises on an `Error` (the pump turns it into `NodeFailed`)."""
    match msg:
        case m.TokenItem():
            return Tokens(node, msg)
        case m.Ready():
            return KvReady(node)
        case pm.HandoffRound():
            return RoundSent(node, msg)
    return None
