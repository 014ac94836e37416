"""Typed messages that cross node links.

Every message is a frozen, slotted dataclass with a `tag` Literal; its fields are
validated in `__post_init__`, so a message that exists is well formed whether
it was built locally or decoded from the wire (`frames.decode`).  The net layer
gives the fields no meaning beyond their shapes: what a request id names, what
"ready" means or what a load number counts is the pipeline's business.

Bulk fields travel as the frame payload, not in the orjson metadata:
`KvChunk.payload` raw, token IDs as little-endian int32, prefix hashes as
little-endian uint64 (see `frames.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

# Limits on metadata fields: generous for real use, small enough that a hostile
# peer cannot make us hold much.
MAX_ID_CHARS = 256
MAX_TEXT_CHARS = 4096
MAX_TOKEN_IDS = 1 << 20
MAX_HASHES = 1 << 20
TOKEN_ID_LIMIT = 1 << 31           # token IDs are int32 >= 0 on the wire
HASH_LIMIT = 1 << 64               # prefix hashes are uint64

DTypeName = Literal["float32", "float16", "bfloat16", "float64"]
DTYPE_SIZES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

Buffer = bytes | bytearray | memoryview


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


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
    # The common case checked in C (prompts are 10^4-10^5 ids); the slow loop names the culprit.
    if values and (set(map(type, values)) != {int} or min(values) < 0  # type: ignore[call-overload]
                   or max(values) >= value_limit):  # type: ignore[call-overload]
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


@dataclass(frozen=True, slots=True)
class KvSpan:
    """What one KV chunk covers: layers [layer_start, layer_end) x tokens [token_start, token_end).

    The payload is a contiguous array `[layers, 2 (K, V), tokens, kv_heads, head_dim]`
    of `dtype`, little-endian; `shape` names those five sizes.  A `virtual`
    span stands for that much KV without carrying it (a cost-model engine's
    KV): its payload is empty, and link shaping charges it `nbytes`.
    """

    request_id: str
    layer_start: int
    layer_end: int
    token_start: int
    token_end: int
    dtype: DTypeName
    shape: tuple[int, ...]
    virtual: bool = False

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _flag(self.virtual, "virtual")
        for name in ("layer_start", "layer_end", "token_start", "token_end"):
            _uint(getattr(self, name), name, 1 << 31)
        _check(self.layer_end > self.layer_start, "layer_end must exceed layer_start")
        _check(self.token_end > self.token_start, "token_end must exceed token_start")
        _check(type(self.dtype) is str and self.dtype in DTYPE_SIZES,
               f"dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        _int_tuple(self, "shape", self.shape, 5, 1 << 31)
        _check(len(self.shape) == 5, "shape must be [layers, 2, tokens, kv_heads, head_dim]")
        layers, kv, tokens, heads, dim = self.shape
        _check(layers == self.layer_end - self.layer_start, "shape[0] must equal layer_end - layer_start")
        _check(kv == 2, "shape[1] must be 2 (K and V)")
        _check(tokens == self.token_end - self.token_start, "shape[2] must equal token_end - token_start")
        _check(heads > 0 and dim > 0, "kv_heads and head_dim must be > 0")
        _check(self.nbytes < 1 << 40, "span too large")

    @property
    def nbytes(self) -> int:
        """Payload size in bytes."""
        layers, kv, tokens, heads, dim = self.shape
        return layers * kv * tokens * heads * dim * DTYPE_SIZES[self.dtype]

    @property
    def payload_nbytes(self) -> int:
        """Bytes the frame's payload carries: nbytes, or 0 for a virtual span."""
        return 0 if self.virtual else self.nbytes


@dataclass(frozen=True, slots=True)
class KvChunk:
    """One chunk of a request's KV.

    `payload` is any C-contiguous buffer of exactly `span.nbytes` bytes (bytes,
    bytearray, memoryview of tensor memory: `memoryview(t.view(torch.uint8).numpy())`);
    it is sent without copying, so it must stay unchanged until `Link.send`
    returns.  On the receiving side it is the memoryview the link's KV sink
    returned (bytes already in place) or a fresh bytearray.
    """

    span: KvSpan
    payload: Buffer = field(repr=False)
    seq: int = 0                   # chunk index within its transfer (the sender's numbering)
    last: bool = False             # final chunk of the transfer; ends a `Link.stream`
    tag: Literal["kv_chunk"] = "kv_chunk"

    def __post_init__(self) -> None:
        _check(isinstance(self.span, KvSpan), "span must be a KvSpan")
        _check(isinstance(self.payload, (bytes, bytearray, memoryview)), "payload must be a bytes-like buffer")
        mv = memoryview(self.payload)
        _check(mv.c_contiguous, "payload must be C-contiguous")
        _check(mv.nbytes == self.span.payload_nbytes,
               f"payload has {mv.nbytes} bytes, span needs {self.span.payload_nbytes}")
        _uint(self.seq, "seq", 1 << 31)
        _flag(self.last, "last")

    @property
    def request_id(self) -> str:
        return self.span.request_id


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
        _text(self.request_id, "request_id")
        _uint(self.position, "position", 1 << 31)
        _int_tuple(self, "ids", self.ids, MAX_TOKEN_IDS, TOKEN_ID_LIMIT)
        _flag(self.done, "done")
        _text(self.reason, "reason")


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
    """A node's load, as numbers the router's policy weighs."""

    node: str
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    kv_bytes_in_flight: int = 0
    tokens_per_s: float = 0.0
    tag: Literal["load"] = "load"

    def __post_init__(self) -> None:
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


Message = (Hello | Challenge | Auth | Welcome | KvChunk | TokenIds | TokenItem | Ready | Ack | Cancel
           | Error | LoadReport | PrefixQuery | PrefixAnswer | Ping | Pong)

# Wire kind byte of each message class.  Append only: the numbers are protocol.
KINDS: dict[int, type] = {
    1: Hello, 2: Challenge, 3: Auth, 4: Welcome,
    10: KvChunk, 11: TokenIds, 12: TokenItem,
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
    if isinstance(msg, KvChunk):
        return msg.last
    return isinstance(msg, Cancel)
