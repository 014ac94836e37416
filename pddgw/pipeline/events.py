"""What the router's stream loop consumes: one typed event per thing that happened.

The pumps of a request (P's Prefill reply, each decoder's token stream, the
handoff) turn link messages and link failures into these at the edge
(`from_message`), so the loop in router.py matches on meaning, not on wire
types.  `node` is the router's handle of the node it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pddgw.net import messages as m
from pddgw.net.errors import LinkError
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


def from_message(node: Any, msg: m.Message | LinkError | BaseException) -> Event | None:
    """A pumped message or failure -> its event (None: nothing the loop acts on)."""
    match msg:
        case m.TokenItem():
            return Tokens(node, msg)
        case pm.PrefillDone():
            return PrefillFinished(node, msg)
        case m.Ready():
            return KvReady(node)
        case pm.HandoffRound():
            return RoundSent(node, msg)
        case pm.HandedOff():
            return HandoffEnded(node, msg)
        case m.Error(message=why):
            return NodeFailed(node, why)
        case LinkError():
            return NodeFailed(node, str(msg))
        case BaseException():
            return NodeFailed(node, repr(msg))
    return None
