"""Pipeline messages: the control vocabulary of the PDD roles on node links.

The net layer carries them like its own messages (fixed header, orjson
metadata of the fields, token IDs packed as the payload) and validates them
at decode through `__post_init__`; their meaning lives here.  A request's
sampling travels as one nested `SamplingParams`, validated by its own
constructor.  Who sends what, and which messages are answered:
docs/protocol.md.

Invariants:
  * `Logprobs` pieces (only for a request that asks) travel right before the
    message carrying their tokens, on the same link and traffic class, at
    most MAX_LOGPROB_POSITIONS positions each, so the receiver joins them at
    its edge;
  * prompt logprobs stay on the node that computed the prompt (`PromptScores`)
    until the router asks (`PromptLogprobsQuery`) after the request ended;
  * handed-off tokens (`Extend`) carry no logprobs: RLD already emitted them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pddgw.core.errors import check as _check
from pddgw.core.ids import TOKEN_ID_LIMIT
from pddgw.core.sampling import MAX_LOGPROBS, SamplingParams
from pddgw.core.tokens import LOGPROB_FLOOR, TokenLogprobs
from pddgw.engines.types import RequestError
from pddgw.net.messages import MAX_ID_CHARS, MAX_TEXT_CHARS, MAX_TOKEN_IDS
from pddgw.net.messages import _flag, _int_tuple, _number, _text, _uint

MAX_TARGETS = 16
# Positions per Logprobs message: 64 x 21 floats of <= 24 JSON characters stay well inside
# the frame's 64 KiB of metadata.
MAX_LOGPROB_POSITIONS = 64


def _sampling(sp: object) -> None:
    """A message's nested sampling (its own constructor validated the values)."""
    _check(type(sp) is SamplingParams, "sampling must be a SamplingParams")


def _bools(obj: object, name: str, values: object, count: int) -> None:
    """A per-target tuple of booleans (empty = all False)."""
    _check(type(values) in (tuple, list) and len(values) in (0, count),  # type: ignore[arg-type]
           f"{name} must have one entry per target")
    object.__setattr__(obj, name, tuple(values))  # type: ignore[arg-type]
    for v in values:  # type: ignore[union-attr]
        _flag(v, f"{name}[]")


@dataclass(frozen=True, slots=True)
class Submit:
    """Open a request on a decode node.

    kv="import": P will stream the prompt KV past this node's cached prefix,
    then KvDone, which says whether to decode at once (RLD; MD in P-MD) or
    hold until a final handoff (MD in P-RLD-MD), so `hold` is ignored.
    kv="compute": the node computes the prompt itself (a re-drive); with
    hold=True the tokens already emitted then arrive as one final Extend.
    `supersedes`: requests to cancel here first (background alignments this
    one makes moot), so the prefix this request finds includes what they
    had already imported.
    """

    request_id: str
    kv: Literal["import", "compute"]
    hold: bool
    prompt: tuple[int, ...]
    supersedes: tuple[str, ...] = ()
    sampling: SamplingParams = field(kw_only=True)
    tag: Literal["submit"] = "submit"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", empty=False)
        _check(self.kv in ("import", "compute"), "kv must be 'import' or 'compute'")
        _flag(self.hold, "hold")
        _sampling(self.sampling)
        _int_tuple(self, "prompt", self.prompt, MAX_TOKEN_IDS, TOKEN_ID_LIMIT)
        _check(len(self.prompt) > 0, "prompt must not be empty")
        _check(type(self.supersedes) in (tuple, list) and len(self.supersedes) <= MAX_TARGETS,
               f"supersedes must list at most {MAX_TARGETS} request ids")
        object.__setattr__(self, "supersedes", tuple(self.supersedes))
        for r in self.supersedes:
            _text(r, "supersedes[]", empty=False)


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
class Prefill:
    """Compute the prompt on P; stream its KV to `targets` from `starts` on (parallel).

    `holds[i]`: target i holds after the KV (KvDone.hold), else decodes at once.
    """

    request_id: str
    targets: tuple[str, ...]
    starts: tuple[int, ...]
    prompt: tuple[int, ...]
    holds: tuple[bool, ...] = ()
    sampling: SamplingParams = field(kw_only=True)
    tag: Literal["prefill"] = "prefill"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", empty=False)
        _check(type(self.targets) in (tuple, list) and 0 < len(self.targets) <= MAX_TARGETS,
               f"targets must list 1..{MAX_TARGETS} node names")
        object.__setattr__(self, "targets", tuple(self.targets))
        for t in self.targets:
            _text(t, "targets[]", MAX_ID_CHARS, empty=False)
        _int_tuple(self, "starts", self.starts, MAX_TARGETS, TOKEN_ID_LIMIT)
        _check(len(self.starts) == len(self.targets), "starts must have one entry per target")
        _sampling(self.sampling)
        _int_tuple(self, "prompt", self.prompt, MAX_TOKEN_IDS, TOKEN_ID_LIMIT)
        _check(len(self.prompt) > 0, "prompt must not be empty")
        _check(all(s <= len(self.prompt) for s in self.starts), "a start is past the prompt's end")
        _bools(self, "holds", self.holds, len(self.targets))


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
class KvDone:
    """P -> decoder: the prompt KV is all sent; `first_token` (sampled by P) is
    output position 0.  hold=False: decode on at once; True: wait for the handoff."""

    request_id: str
    first_token: int
    hold: bool
    tag: Literal["kv_done"] = "kv_done"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", empty=False)
        _uint(self.first_token, "first_token", TOKEN_ID_LIMIT)
        _flag(self.hold, "hold")


@dataclass(frozen=True, slots=True)
class PromptLogprobsQuery:
    """router -> the node that computed a request's prompt: its prompt logprobs from prompt
    token `start` (>= 1) on; answered by one `Logprobs` piece of at most
    MAX_LOGPROB_POSITIONS positions (`position`: the prompt index), asked again until all are in."""

    request_id: str
    start: int
    tag: Literal["prompt_logprobs_query"] = "prompt_logprobs_query"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", empty=False)
        _uint(self.start, "start", 1 << 31)
        _check(self.start >= 1, "start must be >= 1 (prompt token 0 has no logprob)")


class PromptScores:
    """A node's prompt logprobs kept for the router until its Cancel: request id -> one
    `TokenLogprobs` per prompt token 1..n-1.  Bounded: past `limit` requests (a router that
    never came back for them) the oldest go."""

    def __init__(self, limit: int = 1024) -> None:
        self.limit = limit
        self._by_id: dict[str, tuple[TokenLogprobs, ...]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def put(self, request_id: str, entries: tuple[TokenLogprobs, ...]) -> None:
        self._by_id.pop(request_id, None)
        self._by_id[request_id] = entries
        while len(self._by_id) > self.limit:
            del self._by_id[next(iter(self._by_id))]

    def drop(self, request_id: str) -> None:
        self._by_id.pop(request_id, None)

    def piece(self, query: PromptLogprobsQuery) -> Logprobs:
        """The answer to a query; RequestError when this node has none for it."""
        entries = self._by_id.get(query.request_id)
        if entries is None:
            raise RequestError(f"request {query.request_id!r}: no prompt logprobs here")
        if not query.start <= len(entries):
            raise RequestError(f"request {query.request_id!r}: prompt logprobs start {query.start} "
                               f"past the last prompt token {len(entries)}")
        return logprob_pieces(query.request_id, query.start,
                              entries[query.start - 1 : query.start - 1 + MAX_LOGPROB_POSITIONS])[0]


@dataclass(frozen=True, slots=True)
class Logprobs:
    """Log-probabilities of output positions [position, position + n) of a request.

    Sent right before the message carrying those tokens (module docstring).
    `logprobs[i]` is the sampled token's at position + i; `top_ids` / `top_logprobs`
    hold top_n alternatives per position, row by row, most probable first.  Values are finite, in [LOGPROB_FLOOR, 0]
    (-inf travels as the floor); the ids are the packed payload.
    """

    request_id: str
    position: int
    top_n: int
    logprobs: tuple[float, ...]
    top_logprobs: tuple[float, ...]
    top_ids: tuple[int, ...]
    tag: Literal["logprobs"] = "logprobs"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", empty=False)
        _uint(self.position, "position", 1 << 31)
        _uint(self.top_n, "top_n", MAX_LOGPROBS + 1)
        _floats(self, "logprobs", self.logprobs, MAX_LOGPROB_POSITIONS)
        n = len(self.logprobs)
        _check(n >= 1, "logprobs must cover at least one position")
        _floats(self, "top_logprobs", self.top_logprobs, n * self.top_n)
        _int_tuple(self, "top_ids", self.top_ids, n * self.top_n, TOKEN_ID_LIMIT)
        _check(len(self.top_logprobs) == len(self.top_ids) == n * self.top_n,
               "top_logprobs and top_ids must hold top_n entries per position")

    def entries(self) -> tuple[TokenLogprobs, ...]:
        k = self.top_n
        return tuple(TokenLogprobs(lp, self.top_ids[i * k : (i + 1) * k], self.top_logprobs[i * k : (i + 1) * k])
                     for i, lp in enumerate(self.logprobs))


def _floats(obj: object, name: str, values: object, count_limit: int) -> None:
    """A tuple of at most `count_limit` log-probabilities: finite, in [LOGPROB_FLOOR, 0]."""
    _check(type(values) in (tuple, list) and len(values) <= count_limit,  # type: ignore[arg-type]
           f"{name} must list at most {count_limit} numbers")
    out = []
    for v in values:  # type: ignore[union-attr]
        _check(type(v) in (int, float) and math.isfinite(v) and LOGPROB_FLOOR <= v <= 0,
               f"{name}: {v!r} is not a log-probability in [{LOGPROB_FLOOR}, 0]")
        out.append(float(v))
    object.__setattr__(obj, name, tuple(out))


def logprob_pieces(request_id: str, position: int, entries: Sequence[TokenLogprobs]) -> list[Logprobs]:
    """The Logprobs messages for positions [position, position + len(entries)), in order.

    Every entry must have the same number of alternatives (the request's k)."""
    out = []
    for a in range(0, len(entries), MAX_LOGPROB_POSITIONS):
        part = entries[a : a + MAX_LOGPROB_POSITIONS]
        k = len(part[0].top_ids)
        out.append(Logprobs(request_id, position + a, k, tuple(max(e.logprob, LOGPROB_FLOOR) for e in part),
                            tuple(max(v, LOGPROB_FLOOR) for e in part for v in e.top_logprobs),
                            tuple(t for e in part for t in e.top_ids)))
    return out


@dataclass(frozen=True, slots=True)
class Demote:
    """Router -> P: nobody waits for this request's KV any more (RLD answered it);
    what is left of its transfers goes as background traffic, behind live requests."""

    request_id: str
    tag: Literal["demote"] = "demote"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", empty=False)


@dataclass(frozen=True, slots=True)
class HandOff:
    """Router -> RLD: hand the request off to MD node `target` by token IDs."""

    request_id: str
    target: str
    mode: Literal["one-shot", "catch-up"]
    threshold: int
    max_chunk: int
    max_rounds: int
    # The router's WAN RTT estimate: RLD's first guess of a round's duration.
    rtt_ms: float = 0.0
    # The operator forced the mode: no one-shot fallback when catch-up cannot converge.
    forced: bool = False
    tag: Literal["hand_off"] = "hand_off"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", empty=False)
        _text(self.target, "target", empty=False)
        _check(self.mode in ("one-shot", "catch-up"), "mode must be 'one-shot' or 'catch-up'")
        for name in ("threshold", "max_chunk", "max_rounds"):
            _uint(getattr(self, name), name, 1 << 20)
        _check(1 <= self.threshold <= self.max_chunk and self.max_rounds >= 1,
               "need 1 <= threshold <= max_chunk and max_rounds >= 1")
        _number(self.rtt_ms, "rtt_ms")
        _flag(self.forced, "forced")


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
class Extend:
    """Output tokens at positions [start, start + len(ids)) for a held request (answered by Ack).

    A handoff round from RLD to MD, or the emitted tokens of a re-drive.
    final=True lifts the hold: the receiver samples from the next position on.
    """

    request_id: str
    start: int
    final: bool
    ids: tuple[int, ...]
    tag: Literal["extend"] = "extend"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id", empty=False)
        _uint(self.start, "start", 1 << 31)
        _flag(self.final, "final")
        _int_tuple(self, "ids", self.ids, MAX_TOKEN_IDS, TOKEN_ID_LIMIT)


@dataclass(frozen=True, slots=True)
class StateQuery:
    """Router -> node: report your state (answered by NodeState)."""

    node: str
    tag: Literal["state_query"] = "state_query"

    def __post_init__(self) -> None:
        _text(self.node, "node")


@dataclass(frozen=True, slots=True)
class NodeState:
    """A node's KV pool and what it has in flight (`/debug/state`)."""

    node: str
    role: str
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
        _text(self.role, "role")
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


# Wire kinds of the pipeline's messages (net's own are below 100).  Append only.
PIPELINE_KINDS: dict[int, tuple[type, str]] = {
    100: (Submit, "prompt"), 101: (Opened, ""), 102: (Prefill, "prompt"), 103: (PrefillDone, ""),
    104: (HandOff, ""), 105: (HandedOff, ""), 106: (HandoffRound, ""), 107: (Extend, "ids"),
    108: (StateQuery, ""), 109: (NodeState, ""), 110: (KvDone, ""), 111: (Demote, ""),
    112: (Logprobs, "top_ids"), 113: (PromptLogprobsQuery, ""),
    130: (Draining, ""),        # well above the others' next kinds: parallel work appends there
}


def _register() -> None:
    from pddgw.net import frames

    for kind, (cls, packed) in PIPELINE_KINDS.items():
        frames.register(kind, cls, packed)


_register()
