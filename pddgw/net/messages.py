"""Typed messages that cross node links.

Every message is a frozen, slotted dataclass with a `tag` Literal; its fields are
validated in `__post_init__`, so a message that exists is well formed whether
it was built locally or decoded from the wire (`frames.decode`).  The net layer
gives the fields no meaning beyond their shapes: what a request id names, what
"ready" means or what a load number counts is the pipeline's business.

Bulk fields travel as the frame payload, not in the orjson metadata:
`KVChunk.payload` raw, token IDs as little-endian int32, prefix hashes as
little-endian uint64 (see `frames.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pddgw.core.errors import check as _check
from pddgw.core.ids import TOKEN_ID_LIMIT, in_range
from pddgw.core.kv import MAX_REQUEST_ID_CHARS, Buffer, KVChunk, KVSpan  # noqa: F401  (part of this module's message set)

# Limits on metadata fields: generous for real use, small enough that a hostile
# peer cannot make us hold much.
MAX_ID_CHARS = MAX_REQUEST_ID_CHARS
MAX_TEXT_CHARS = 4096
MAX_TOKEN_IDS = 1 << 20
MAX_BATCH_ITEMS = 4096             # TokenItems in one TokenBatch (their ids together: MAX_TOKEN_IDS)
MAX_HASHES = 1 << 20
HASH_LIMIT = 1 << 64               # prefix hashes are uint64


def _text(v: object, name: str, limit: int = MAX_ID_CHARS, empty: bool = True) -> None:
    _check(type(v) is str, f"{name} must be a string")
    _check(len(v) <= limit, f"{name} longer than {limit} characters")  # type: ignore[arg-type]
    _check(empty or bool(v), f"{name} must not be empty")


def _uint(v: object, name: str, limit: int = 1 << 63) -> None:
    _check(type(v) is int, f"{name} must be an integer")
    _check(0 <= v < limit, f"{name} out of range [0, {limit})")  # type: ignore[operator]


def _flag(v: object, name: str) -> None:
    _check(type(v) is bool, f"{name} must be a boolean")


def _number(v: object, name: str) -> None:
    ok = (type(v) is int and 0 <= v < 1 << 63) or (type(v) is float and math.isfinite(v) and v >= 0)
    _check(ok, f"{name} must be a finite number >= 0")


def _int_tuple(obj: object, name: str, values: object, count_limit: int, value_limit: int) -> None:
    """Normalise a sequence field to a tuple of ints and range-check it."""
    if type(values) is not tuple:
        _check(isinstance(values, (list, range)) or hasattr(values, "tolist"), f"{name} must be a sequence of ints")
        values = tuple(values.tolist() if hasattr(values, "tolist") else values)  # type: ignore[union-attr]
        object.__setattr__(obj, name, values)
    _check(len(values) <= count_limit, f"{name}: more than {count_limit} values")  # type: ignore[arg-type]
    # The common case checked in C, once per tuple object (prompts are 10^4-10^5 ids and cross
    # several messages in one process: core.ids); the slow loop names the culprit.
    if not in_range(values, value_limit):  # type: ignore[arg-type]
        for v in values:  # type: ignore[union-attr]
            _check(type(v) is int and 0 <= v < value_limit, f"{name}: {v!r} out of range [0, {value_limit})")


# ---------------------------------------------------------------------------
# Link handshake (see ws.py for the sequence)


@dataclass(frozen=True, slots=True)
class Hello:
    """Client -> server, first frame of a connection: who I am, which link and stripe."""

    node: str
    link_id: str                   # shared by every stripe of one link connection
    stripe: int
    stripes: int
    nonce: str                     # client nonce, 64 hex characters
    shaping: str = ""              # name of the link's shaping in the server's config
    tag: Literal["hello"] = "hello"

    def __post_init__(self) -> None:
        _text(self.node, "node", empty=False)
        _text(self.link_id, "link_id", empty=False)
        _uint(self.stripes, "stripes", 17)
        _check(self.stripes >= 1, "stripes must be >= 1")
        _uint(self.stripe, "stripe", self.stripes)
        _nonce(self.nonce, "nonce")
        _text(self.shaping, "shaping")


@dataclass(frozen=True, slots=True)
class Challenge:
    """Server -> client: server nonce and the server's proof that it knows the secret."""

    node: str
    nonce: str
    proof: str                     # hex HMAC-SHA256
    tag: Literal["challenge"] = "challenge"

    def __post_init__(self) -> None:
        _text(self.node, "node", empty=False)
        _nonce(self.nonce, "nonce")
        _nonce(self.proof, "proof")


@dataclass(frozen=True, slots=True)
class Auth:
    """Client -> server: the client's proof."""

    proof: str
    tag: Literal["auth"] = "auth"

    def __post_init__(self) -> None:
        _nonce(self.proof, "proof")


@dataclass(frozen=True, slots=True)
class Welcome:
    """Server -> client: authenticated; the link is open."""

    tag: Literal["welcome"] = "welcome"


def _nonce(v: object, name: str) -> None:
    _check(type(v) is str and len(v) == 64 and all(c in "0123456789abcdef" for c in v),  # type: ignore[union-attr]
           f"{name} must be 64 lowercase hex characters")


# ---------------------------------------------------------------------------
# KV transfer


# `KVSpan` and `KVChunk` (kind 10) live in pddgw.core.kv: engines build and import the very
# value a link sends and delivers, validated by their constructors like every message here.


# ---------------------------------------------------------------------------
# Tokens


@dataclass(frozen=True, slots=True)
class TokenIds:
    """Token-ID handoff: `ids` are the tokens at positions start, start+1, ... (packed int32)."""

    request_id: str
    start: int
    ids: tuple[int, ...]
    tag: Literal["token_ids"] = "token_ids"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _uint(self.start, "start", 1 << 31)
        _int_tuple(self, "ids", self.ids, MAX_TOKEN_IDS, TOKEN_ID_LIMIT)


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


# ---------------------------------------------------------------------------
# Control


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
class Ack:
    """Acknowledges `request_id` up to `seq` (e.g. KV chunks received and placed)."""

    request_id: str
    seq: int = 0
    detail: str = ""
    tag: Literal["ack"] = "ack"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _uint(self.seq, "seq")
        _text(self.detail, "detail", MAX_TEXT_CHARS)


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop working on `request_id`; ends a `Link.stream`."""

    request_id: str
    reason: str = ""
    tag: Literal["cancel"] = "cancel"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _text(self.reason, "reason", MAX_TEXT_CHARS)


@dataclass(frozen=True, slots=True)
class Error:
    """A failure on the peer; a request answered with it raises `RemoteError`."""

    request_id: str
    code: str
    message: str = ""
    tag: Literal["error"] = "error"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _text(self.code, "code", empty=False)
        _text(self.message, "message", MAX_TEXT_CHARS)


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
class PrefixQuery:
    """Which of these chained block hashes (uint64, in prompt order) do you hold?"""

    request_id: str
    hashes: tuple[int, ...]
    tag: Literal["prefix_query"] = "prefix_query"

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _int_tuple(self, "hashes", self.hashes, MAX_HASHES, HASH_LIMIT)


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
class Ping:
    """Heartbeat; answered by a `Pong` carrying the same `sent_ns`."""

    sent_ns: int
    tag: Literal["ping"] = "ping"

    def __post_init__(self) -> None:
        _uint(self.sent_ns, "sent_ns")


@dataclass(frozen=True, slots=True)
class Pong:
    sent_ns: int
    tag: Literal["pong"] = "pong"

    def __post_init__(self) -> None:
        _uint(self.sent_ns, "sent_ns")


Message = (Hello | Challenge | Auth | Welcome | KVChunk | TokenIds | TokenItem | TokenBatch | Ready | Ack
           | Cancel | Error | LoadReport | PrefixQuery | PrefixAnswer | Ping | Pong)

# Wire kind byte of each message class.  Append only: the numbers are protocol.
KINDS: dict[int, type] = {
    1: Hello, 2: Challenge, 3: Auth, 4: Welcome,
    10: KVChunk, 11: TokenIds, 12: TokenItem, 13: TokenBatch,
    20: Ready, 21: Ack, 22: Cancel, 23: Error,
    30: LoadReport, 31: PrefixQuery, 32: PrefixAnswer,
    40: Ping, 41: Pong,
}
KIND_OF: dict[type, int] = {cls: kind for kind, cls in KINDS.items()}
KV_KIND = 10
HANDSHAKE_KINDS: frozenset[int] = frozenset({1, 2, 3, 4})


def ends_stream(msg: Message) -> bool:
    """True for the message that ends a `Link.stream` (after being yielded)."""
    if isinstance(msg, TokenItem):
        return msg.done
    if isinstance(msg, KVChunk):
        return msg.last
    return isinstance(msg, Cancel)
