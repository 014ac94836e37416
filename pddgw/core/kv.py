"""The one KV span / chunk type that engines, links and the pipeline share.

A `KVSpan` says which KV a chunk carries: layers [layer_start, layer_end) x
tokens [token_start, token_end) of one request, laid out as a contiguous
array `[layers, 2 (K, V), tokens, kv_heads, head_dim]` of `dtype`
(little-endian).  A `KVChunk` is a span plus its payload, numbered within
its transfer.

Contract:
  * A value that exists is well formed: `__post_init__` checks every field in
    O(1) (the payload's size, never its bytes) and raises ValueError naming
    the field; frame decoding and KV import rely on it.
  * `KVSpan`'s field names and order (then `seq`, `last`) are the KV frame's
    wire metadata (`net.frames`): changing them changes the protocol.
  * A `virtual` span (a cost model's KV) stands for `nbytes` without carrying
    them; links charge the full size.
  * A payload is sent without copying: it must stay unchanged until the
    link's send returns.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from pddgw.core.errors import check as _check

T = TypeVar("T")

DTypeName = Literal["float32", "float16", "bfloat16", "float64"]
DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
MAX_REQUEST_ID_CHARS = 256          # = messages.MAX_ID_CHARS: a hostile peer cannot make us hold much
_RANGE_LIMIT = 1 << 31              # token / layer indices and shape sizes are int32 on every side
_MAX_SPAN_BYTES = 1 << 40

Buffer = bytes | bytearray | memoryview


def _index(v: Any, name: str) -> None:
    _check(type(v) is int, f"{name} must be an integer")
    _check(0 <= v < _RANGE_LIMIT, f"{name} out of range [0, {_RANGE_LIMIT})")


@dataclass(frozen=True, slots=True)
class KVSpan:
    """Which KV a chunk carries, known before its payload (see `Engine.import_buffer`, `net.link.KvSink`)."""

    request_id: str
    layer_start: int
    layer_end: int
    token_start: int
    token_end: int
    dtype: DTypeName
    shape: tuple[int, ...]          # [layers, 2, tokens, kv_heads, head_dim]
    virtual: bool = False

    def __post_init__(self) -> None:
        # Every check is a comparison or two (one frame's worth of work is microseconds).
        _check(type(self.request_id) is str, "request_id must be a string")
        _check(len(self.request_id) <= MAX_REQUEST_ID_CHARS,
               f"request_id longer than {MAX_REQUEST_ID_CHARS} characters")
        _check(type(self.virtual) is bool, "virtual must be a boolean")
        ranges = (self.layer_start, self.layer_end, self.token_start, self.token_end)
        if not (set(map(type, ranges)) == {int} and min(ranges) >= 0 and max(ranges) < _RANGE_LIMIT):
            for name, v in zip(("layer_start", "layer_end", "token_start", "token_end"), ranges):
                _index(v, name)
        _check(self.layer_end > self.layer_start, "layer_end must exceed layer_start")
        _check(self.token_end > self.token_start, "token_end must exceed token_start")
        _check(type(self.dtype) is str and self.dtype in DTYPE_ITEMSIZE,
               f"dtype {self.dtype!r} is not one of {sorted(DTYPE_ITEMSIZE)}")
        shape = self.shape
        if type(shape) is not tuple:            # a decoded frame carries a list
            _check(isinstance(shape, list), "shape must be a sequence of 5 ints")
            shape = tuple(shape)
            object.__setattr__(self, "shape", shape)
        _check(len(shape) == 5, "shape must be [layers, 2, tokens, kv_heads, head_dim]")
        if not (set(map(type, shape)) == {int} and min(shape) >= 0 and max(shape) < _RANGE_LIMIT):
            for i, v in enumerate(shape):
                _check(type(v) is int and 0 <= v < _RANGE_LIMIT, f"shape[{i}]: {v!r} out of range [0, {_RANGE_LIMIT})")
        layers, kv, tokens, heads, dim = shape
        _check(layers == self.layer_end - self.layer_start, "shape[0] must equal layer_end - layer_start")
        _check(kv == 2, "shape[1] must be 2 (K and V)")
        _check(tokens == self.token_end - self.token_start, "shape[2] must equal token_end - token_start")
        _check(heads > 0 and dim > 0, "kv_heads and head_dim must be > 0")
        _check(layers * 2 * tokens * heads * dim * DTYPE_ITEMSIZE[self.dtype] < _MAX_SPAN_BYTES, "span too large")

    @classmethod
    def of(cls, request_id: str, *, tokens: tuple[int, int], layers: tuple[int, int], num_kv_heads: int,
           head_dim: int, dtype: DTypeName, virtual: bool = False) -> KVSpan:
        """The span of tokens [tokens[0], tokens[1]) x layers [layers[0], layers[1]) of a model's KV."""
        (t0, t1), (l0, l1) = tokens, layers
        return cls(request_id, l0, l1, t0, t1, dtype, (l1 - l0, 2, t1 - t0, num_kv_heads, head_dim), virtual)

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_kv_heads(self) -> int:
        return self.shape[3]

    @property
    def head_dim(self) -> int:
        return self.shape[4]

    @property
    def nbytes(self) -> int:
        """Bytes of the KV this span stands for (what crosses a link, what shaping charges)."""
        layers, kv, tokens, heads, dim = self.shape
        return layers * kv * tokens * heads * dim * DTYPE_ITEMSIZE[self.dtype]

    @property
    def payload_nbytes(self) -> int:
        """Bytes a chunk's payload carries: nbytes, or 0 for a virtual span."""
        return 0 if self.virtual else self.nbytes


class _SpanField(Generic[T]):
    """A read-only attribute of a KVChunk forwarded from its `span`."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._get = operator.attrgetter(f"span.{name}")

    def __get__(self, obj: object, owner: type | None = None) -> T:
        return self._get(obj)


@dataclass(frozen=True, slots=True)
class KVChunk:
    """One chunk of a request's KV: `span` and exactly `span.payload_nbytes` bytes of `payload`.

    `payload` is any C-contiguous buffer (bytes, bytearray, or a memoryview of
    tensor memory: `memoryview(t.view(torch.uint8).numpy())`).  `seq` and
    `last` are the sender's numbering within a transfer; an engine's export
    leaves them 0 / False and the sender sets them (`dataclasses.replace`).
    The span's fields most readers want are forwarded read-only.
    """

    span: KVSpan
    payload: Buffer = field(repr=False)
    seq: int = 0                   # chunk index within its transfer (the sender's numbering)
    last: bool = False             # final chunk of the transfer; ends a `Link.stream`
    tag: Literal["kv_chunk"] = "kv_chunk"      # the message tag on the wire (pddgw.messages)

    request_id = _SpanField[str]()
    token_start = _SpanField[int]()
    token_end = _SpanField[int]()
    layer_start = _SpanField[int]()
    layer_end = _SpanField[int]()
    num_tokens = _SpanField[int]()
    dtype = _SpanField[str]()
    shape = _SpanField[tuple[int, ...]]()
    virtual = _SpanField[bool]()
    nbytes = _SpanField[int]()
    payload_nbytes = _SpanField[int]()

    def __post_init__(self) -> None:
        _check(isinstance(self.span, KVSpan), "span must be a KVSpan")
        _check(isinstance(self.payload, (bytes, bytearray, memoryview)), "payload must be a bytes-like buffer")
        mv = self.payload if isinstance(self.payload, memoryview) else memoryview(self.payload)
        _check(mv.c_contiguous, "payload must be C-contiguous")
        _check(mv.nbytes == self.span.payload_nbytes,
               f"payload has {mv.nbytes} bytes, span needs {self.span.payload_nbytes}")
        if not (type(self.seq) is int and 0 <= self.seq < _RANGE_LIMIT):
            _index(self.seq, "seq")
        _check(type(self.last) is bool, "last must be a boolean")
