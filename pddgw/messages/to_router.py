"""Worker -> router messages: replies, output tokens and the node's state.

TokenItem (or a step's TokenBatch, split into items at the router's edge) is
the position-keyed output stream; `done` ends it.  Ready(detail="kv") says MD
holds the prompt KV; HandoffRound and Draining are one-way notices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pddgw.core.errors import check as _check
from pddgw.core.roles import ROLES, Role
from pddgw.core.ids import TOKEN_ID_LIMIT, in_range
from pddgw.messages.fields import (MAX_BATCH_ITEMS, MAX_HASHES, MAX_ID_CHARS, MAX_TARGETS, MAX_TEXT_CHARS,
                                   MAX_TOKEN_IDS, _flag, _int_tuple, _number, _text, _uint)


@dataclass(frozen=True, slots=True)
class PrefixAnswer:
    """The first `held` hashes of the query are held (and pinned until the transfer ends)."""

    request_id: str
    held: int
    tag: Literal["prefix_answer"] = "prefix_answer"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _uint(self.held, "held", MAX_HASHES + 1)


@dataclass(frozen=True, slots=True)
class Opened:
    """Reply to Submit: this node already holds `cached_tokens` of the prompt."""

    request_id: str
    cached_tokens: int
    tag: Literal["opened"] = "opened"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _uint(self.cached_tokens, "cached_tokens", 1 << 31)


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """Reply to Prefill: the first token, P's own cache hit, and per target the KV
    bytes, the seconds they were in service on the wire (a bandwidth sample)
    and the error ("" = none)."""

    request_id: str
    first_token: int
    cached_tokens: int
    sent_bytes: tuple[int, ...]
    errors: tuple[str, ...]
    send_seconds: tuple[float, ...] = ()
    tag: Literal["prefill_done"] = "prefill_done"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _uint(self.first_token, "first_token", TOKEN_ID_LIMIT)
        _uint(self.cached_tokens, "cached_tokens", 1 << 31)
        _int_tuple(self, "sent_bytes", self.sent_bytes, MAX_TARGETS, 1 << 62)
        _check(type(self.errors) in (tuple, list) and len(self.errors) == len(self.sent_bytes),
               "errors must have one entry per target")
        object.__setattr__(self, "errors", tuple(self.errors))
        for e in self.errors:
            _text(e, "errors[]", MAX_TEXT_CHARS)
        _check(type(self.send_seconds) in (tuple, list) and len(self.send_seconds) in (0, len(self.sent_bytes)),
               "send_seconds must have one entry per target")
        object.__setattr__(self, "send_seconds", tuple(self.send_seconds))
        for x in self.send_seconds:
            _number(x, "send_seconds[]")


@dataclass(frozen=True, slots=True)
class Ready:
    """Something named by `detail` is ready for `request_id`."""

    request_id: str
    detail: str = ""
    tag: Literal["ready"] = "ready"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _text(self.detail, "detail", MAX_TEXT_CHARS)


@dataclass(frozen=True, slots=True)
class HandedOff:
    """Reply to HandOff: MD continues from output position `position`."""

    request_id: str
    position: int
    tag: Literal["handed_off"] = "handed_off"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _uint(self.position, "position", 1 << 31)


@dataclass(frozen=True, slots=True)
class HandoffRound:
    """RLD -> router: a handoff round [start, end) went to MD (final: RLD stopped at end)."""

    request_id: str
    start: int
    end: int
    final: bool
    tag: Literal["handoff_round"] = "handoff_round"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _uint(self.start, "start", 1 << 31)
        _uint(self.end, "end", 1 << 31)
        _check(self.end >= self.start, "end must be >= start")
        _flag(self.final, "final")


@dataclass(frozen=True, slots=True)
class TokenItem:
    """Output stream item: tokens at positions position, position+1, ...; `done` ends the stream."""

    request_id: str
    position: int
    ids: tuple[int, ...]
    done: bool = False
    reason: str = ""               # why it finished (e.g. "stop", "length"), with done
    tag: Literal["token_item"] = "token_item"

    def __post_init__(self) -> None:
        # One per output token or run of them: the common case (none, one, or a stream
        # interval's run) checked inline, the checks below (which name what is wrong) for every other.
        rid, pos, ids, reason = self.request_id, self.position, self.ids, self.reason
        if (type(rid) is str and len(rid) <= MAX_ID_CHARS and type(pos) is int and 0 <= pos < 1 << 31
                and type(self.done) is bool and type(reason) is str and len(reason) <= MAX_ID_CHARS
                and type(ids) is tuple and (not ids or (len(ids) == 1 and type(ids[0]) is int
                                                        and 0 <= ids[0] < TOKEN_ID_LIMIT)
                                            or (len(ids) <= MAX_TOKEN_IDS and in_range(ids, TOKEN_ID_LIMIT)))):
            return
        _text(self.request_id, "request_id")
        _uint(self.position, "position", 1 << 31)
        _int_tuple(self, "ids", self.ids, MAX_TOKEN_IDS, TOKEN_ID_LIMIT)
        _flag(self.done, "done")
        _text(self.reason, "reason")


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Several requests' output stream items in one frame (a decode node sends one engine step's
    items to one router at once).  Never a stream item itself: the receiving link splits it at
    its edge and routes each `TokenItem` as if it had come alone, in order."""

    items: tuple[TokenItem, ...]
    tag: Literal["token_batch"] = "token_batch"

    def __post_init__(self) -> None:
        _check(type(self.items) is tuple, "items must be a tuple of TokenItem")
        _check(1 <= len(self.items) <= MAX_BATCH_ITEMS, f"items: between 1 and {MAX_BATCH_ITEMS} of them")
        _check(all(type(it) is TokenItem for it in self.items), "items must be TokenItems")
        _check(sum(len(it.ids) for it in self.items) <= MAX_TOKEN_IDS, f"items: more than {MAX_TOKEN_IDS} ids")


@dataclass(frozen=True, slots=True)
class NodeState:
    """A node's KV pool and what it has in flight (`/debug/state`)."""

    node: str
    role: Role
    kv_blocks_in_use: int
    kv_blocks_total: int
    kv_blocks_cached: int
    requests: int          # requests the engine holds (running, waiting, importing, retained)
    transfers: int         # KV transfers (prefills) in flight
    sessions: int          # requests open for decode / handoff
    pins: int              # prefix pins awaiting a transfer
    streams: int           # engine output queues still registered (one per live engine request)
    prefix_hit_tokens: int
    prefix_query_tokens: int
    tag: Literal["node_state"] = "node_state"

    def __post_init__(self) -> None:
        _text(self.node, "node")
        _check(self.role in ROLES, f"role must be one of {', '.join(ROLES)}")
        object.__setattr__(self, "role", Role(self.role))
        for name in ("kv_blocks_in_use", "kv_blocks_total", "kv_blocks_cached", "requests", "transfers",
                     "sessions", "pins", "streams", "prefix_hit_tokens", "prefix_query_tokens"):
            _uint(getattr(self, name), name)

    def to_dict(self) -> dict[str, object]:
        return {"node": self.node, "role": self.role, "kv_blocks_in_use": self.kv_blocks_in_use,
                "kv_blocks_total": self.kv_blocks_total, "kv_blocks_cached": self.kv_blocks_cached,
                "inflight": {"requests": self.requests, "transfers": self.transfers,
                             "sessions": self.sessions, "pins": self.pins, "streams": self.streams},
                "prefix_hit_tokens": self.prefix_hit_tokens,
                "prefix_query_tokens": self.prefix_query_tokens}


@dataclass(frozen=True, slots=True)
class LoadReport:
    """A node's load as the node reports it; the router joins it with what it knows (role, slots,
    health) into the policy's `InstanceLoad`."""

    node: str
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    kv_bytes_in_flight: int = 0
    tokens_per_s: float = 0.0
    tag: Literal["load"] = "load"

    def __post_init__(self) -> None:
        # One per load poll and its reply: the valid case checked inline, the checks below (which
        # name what is wrong) for every other.
        node, run, wait, free, total, kv, tps = (self.node, self.running, self.waiting, self.free_blocks,
                                                 self.total_blocks, self.kv_bytes_in_flight, self.tokens_per_s)
        if (type(node) is str and 0 < len(node) <= MAX_ID_CHARS and type(run) is int and type(wait) is int
                and type(free) is int and type(total) is int and type(kv) is int and type(tps) is float
                and 0 <= run < 1 << 63 and 0 <= wait < 1 << 63 and 0 <= free <= total < 1 << 63
                and 0 <= kv < 1 << 63 and 0.0 <= tps < math.inf):
            return
        _text(self.node, "node", empty=False)
        for name in ("running", "waiting", "free_blocks", "total_blocks", "kv_bytes_in_flight"):
            _uint(getattr(self, name), name)
        _check(self.free_blocks <= self.total_blocks, "free_blocks must be <= total_blocks")
        _number(self.tokens_per_s, "tokens_per_s")
        object.__setattr__(self, "tokens_per_s", float(self.tokens_per_s))


@dataclass(frozen=True, slots=True)
class Draining:
    """Worker -> router (one-way, outside any request): this node drains (SIGTERM) and
    exits within `timeout_s`.  The router routes no new request to it until its link
    reconnects (the restarted process); requests already there finish, or the node
    moves them by ending each with an `Error` of code "draining" (the router re-drives
    it from the tokens already emitted).  Sent again with every load poll while the
    node drains, so a router that missed it (a reconnect) hears it within a poll."""

    node: str
    timeout_s: float
    tag: Literal["draining"] = "draining"

    def __post_init__(self) -> None:
        _text(self.node, "node", empty=False)
        _number(self.timeout_s, "timeout_s")
        object.__setattr__(self, "timeout_s", float(self.timeout_s))
