"""Binary frames: fixed header + orjson metadata + raw payload.

Layout (little-endian), one frame per WebSocket binary message::

    0  2s  magic  b"PD"
    2  B   version (1)
    3  B   kind (messages.KINDS)
    4  B   flags (bit 0: reply to the request `corr`)
    5  B   reserved, 0
    6  H   meta_len
    8  I   corr     request/reply correlation id (0: neither)
    12 I   seq      per-link sending order (links striped over connections reorder by it)
    16 I   payload_len
    20 ... meta (orjson object of the message's other fields), then payload

Payloads: `KVChunk.payload` raw; token IDs packed int32; prefix hashes packed
uint64; a `TokenBatch` its items' ids concatenated, its metadata one list per
field, all checked before any item is built.  A dataclass field (e.g.
`SamplingParams`) travels as a nested object with exactly its field names and
is rebuilt through its constructor.  `decode` turns any byte string into a
`Frame` or raises `FrameError` (never another exception); nothing is
evaluated, no pickle.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import struct
import sys
import typing
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from pddgw import messages as m
from pddgw.net.errors import FrameError, FrameTooLarge

MAGIC = b"PD"
VERSION = 1
HEADER = struct.Struct("<2sBBBBHIII")
HEADER_SIZE = HEADER.size  # 20
FLAG_REPLY = 0x01
_KNOWN_FLAGS = FLAG_REPLY
MAX_META = 0xFFFF
MAX_U32 = 0xFFFF_FFFF
_BIG_ENDIAN = sys.byteorder == "big"


@dataclass(frozen=True, slots=True)
class FrameHead:
    kind: int
    flags: int
    meta_len: int
    corr: int
    seq: int
    payload_len: int

    @property
    def size(self) -> int:
        return HEADER_SIZE + self.meta_len + self.payload_len

    @property
    def is_reply(self) -> bool:
        return bool(self.flags & FLAG_REPLY)


@dataclass(frozen=True, slots=True)
class Frame:
    head: FrameHead
    msg: m.Message


@dataclass(frozen=True, slots=True)
class _Schema:
    cls: type
    meta_order: tuple[str, ...]      # encoding order (deterministic bytes)
    meta_fields: frozenset[str]
    packed: str        # "" none, "raw" KV payload, "i" int32 array, "Q" uint64 array, "batch" TokenBatch
    packed_field: str  # message field carried as the payload
    nested: tuple[tuple[str, type], ...] = ()   # fields that are dataclasses: (name, class)
    # msg -> the values of `meta_order`, in that order (one attrgetter call, not a getattr per
    # field: every frame's metadata is read through it).  Not for "raw" and "batch" schemas.
    values: Callable[[Any], tuple[Any, ...]] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        order = self.meta_order
        get: Callable[[Any], tuple[Any, ...]]
        if len(order) > 1:
            get = operator.attrgetter(*order)
        elif order:
            one = operator.attrgetter(order[0])
            get = lambda msg: (one(msg),)       # noqa: E731
        else:
            get = lambda msg: ()                # noqa: E731
        object.__setattr__(self, "values", get)


@functools.cache
def _nested(cls: type) -> tuple[tuple[str, type], ...]:
    """The fields of dataclass `cls` whose declared type is itself a dataclass (once per
    class: a nested field is decoded on every Submit and Prefill)."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls)
                 if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name]))


def _from_json(cls: type, value: object, path: str) -> object:
    """A nested JSON object -> an instance of dataclass `cls`; FrameError names `path`.field."""
    if type(value) is not dict:
        raise FrameError(f"{path} must be a JSON object")
    names = {f.name for f in dataclasses.fields(cls)}
    if value.keys() != names:
        missing, extra = sorted(names - value.keys()), sorted(value.keys() - names)
        raise FrameError(f"{path}: missing {missing}, unknown {[k[:64] for k in extra[:4]]}")
    for name, sub in _nested(cls):
        value[name] = _from_json(sub, value[name], f"{path}.{name}")
    try:
        return cls(**value)
    except (ValueError, TypeError, OverflowError) as e:
        raise FrameError(f"{path}: {e}") from None


# A TokenBatch's metadata: one list per TokenItem field, item i at index i of each.
_BATCH_META = ("request_ids", "positions", "counts", "done", "reasons")


def _schema(cls: type) -> _Schema:
    names = [f.name for f in dataclasses.fields(cls) if f.name != "tag"]
    if cls is m.KVChunk:
        order = tuple(f.name for f in dataclasses.fields(m.KVSpan)) + ("seq", "last")
        return _Schema(cls, order, frozenset(order), "raw", "payload")
    if cls is m.TokenBatch:
        return _Schema(cls, _BATCH_META, frozenset(_BATCH_META), "batch", "items")
    packed, packed_field = m.PACKED.get(cls, ("", ""))
    assert not packed or typing.get_origin(typing.get_type_hints(cls)[packed_field]) is tuple
    order = tuple(n for n in names if n != packed_field)
    return _Schema(cls, order, frozenset(order), packed, packed_field, _nested(cls))


_SCHEMAS: dict[int, _Schema] = {kind: _schema(cls) for kind, cls in m.KINDS.items()}
_ITEM_SIZE = {"i": 4, "Q": 8, "batch": 4}


def _kv_meta(chunk: m.KVChunk) -> bytes:
    span = chunk.span
    return orjson.dumps({
        "request_id": span.request_id, "layer_start": span.layer_start, "layer_end": span.layer_end,
        "token_start": span.token_start, "token_end": span.token_end, "dtype": span.dtype,
        "shape": span.shape, "virtual": span.virtual, "seq": chunk.seq, "last": chunk.last,
    })


def _batch_meta(msg: m.TokenBatch) -> bytes:
    items = msg.items
    return orjson.dumps({"request_ids": [it.request_id for it in items], "positions": [it.position for it in items],
                         "counts": [len(it.ids) for it in items], "done": [it.done for it in items],
                         "reasons": [it.reason for it in items]})


def _batch_items(meta: dict, ids: array) -> tuple[m.TokenItem, ...]:
    """A TokenBatch's items from its checked-shape metadata and its payload's ids."""
    cols = [meta[name] for name in _BATCH_META]
    n = len(cols[0]) if type(cols[0]) is list else -1
    if n < 1 or n > m.MAX_BATCH_ITEMS or any(type(c) is not list or len(c) != n for c in cols):
        raise ValueError(f"items: {_BATCH_META} must be lists of one length in 1..{m.MAX_BATCH_ITEMS}")
    counts = cols[2]
    if any(type(c) is not int or c < 0 for c in counts) or sum(counts) != len(ids):
        raise ValueError(f"counts must be ints >= 0 summing to the payload's {len(ids)} ids")
    items, at = [], 0
    for rid, pos, count, done, reason in zip(*cols):
        items.append(m.TokenItem(rid, pos, tuple(ids[at : at + count]), done, reason))
        at += count
    return tuple(items)


# ---------------------------------------------------------------------------
# Encoding


def encode(msg: m.Message, *, corr: int = 0, seq: int = 0, flags: int = 0) -> tuple[bytes, memoryview]:
    """-> (header + metadata, payload view).  The payload of a KVChunk is not copied."""
    kind = m.KIND_OF[type(msg)]
    schema = _SCHEMAS[kind]
    if schema.packed == "raw":
        chunk = typing.cast(m.KVChunk, msg)              # the schema says which message it is
        meta = _kv_meta(chunk)
        payload = memoryview(chunk.payload).cast("B")
    elif schema.packed == "batch":
        batch = typing.cast(m.TokenBatch, msg)
        meta = _batch_meta(batch)
        arr = array("i")
        for it in batch.items:
            arr.extend(it.ids)
        if _BIG_ENDIAN:
            arr.byteswap()
        payload = memoryview(arr).cast("B")
    else:
        meta = orjson.dumps(dict(zip(schema.meta_order, schema.values(msg))))
        if schema.packed:
            arr = array(schema.packed, getattr(msg, schema.packed_field))
            if _BIG_ENDIAN:
                arr.byteswap()
            payload = memoryview(arr).cast("B")
        else:
            payload = memoryview(b"")
    if len(meta) > MAX_META:
        raise FrameTooLarge(f"metadata of {len(meta)} bytes exceeds {MAX_META}")
    if payload.nbytes > MAX_U32:
        raise FrameTooLarge(f"payload of {payload.nbytes} bytes exceeds 4 GiB")
    head = HEADER.pack(MAGIC, VERSION, kind, flags, 0, len(meta), corr, seq, payload.nbytes)
    return head + meta, payload


def frame_size(msg: m.Message) -> int:
    """len(head) + payload.nbytes of `encode(msg)`, without building the frame.

    In-process links charge the wire by it for every frame (tokens, polls, KV):
    the metadata is still serialized (its length depends on the values), the
    header is a constant and the payload is counted, not packed.  Raises as
    `encode` does.
    """
    kind = m.KIND_OF[type(msg)]
    schema = _SCHEMAS[kind]
    if schema.packed == "raw":
        chunk = typing.cast(m.KVChunk, msg)
        meta_len = len(_kv_meta(chunk))
        payload = memoryview(chunk.payload).nbytes
    elif schema.packed == "batch":
        batch = typing.cast(m.TokenBatch, msg)
        meta_len = len(_batch_meta(batch))
        payload = 4 * sum(len(it.ids) for it in batch.items)
    else:
        meta_len = len(orjson.dumps(dict(zip(schema.meta_order, schema.values(msg)))))
        payload = len(getattr(msg, schema.packed_field)) * _ITEM_SIZE[schema.packed] if schema.packed else 0
    if meta_len > MAX_META:
        raise FrameTooLarge(f"metadata of {meta_len} bytes exceeds {MAX_META}")
    if payload > MAX_U32:
        raise FrameTooLarge(f"payload of {payload} bytes exceeds 4 GiB")
    return HEADER_SIZE + meta_len + payload


def encode_bytes(msg: m.Message, *, corr: int = 0, seq: int = 0, flags: int = 0) -> bytes:
    """The whole frame as one bytes object (copies; for small frames and tests)."""
    head, payload = encode(msg, corr=corr, seq=seq, flags=flags)
    return head + payload.tobytes() if payload.nbytes else head


# ---------------------------------------------------------------------------
# Decoding


def parse_head(buf: m.Buffer, *, max_frame: int = MAX_U32, max_control: int = MAX_U32) -> FrameHead:
    """Parse and check the 20-byte header (`buf` may be longer)."""
    if len(buf) < HEADER_SIZE:
        raise FrameError(f"frame of {len(buf)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, kind, flags, reserved, meta_len, corr, seq, payload_len = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise FrameError(f"unsupported protocol version {version}")
    schema = _SCHEMAS.get(kind)
    if schema is None:
        raise FrameError(f"unknown frame kind {kind}")
    if flags & ~_KNOWN_FLAGS or reserved:
        raise FrameError(f"unknown flags {flags:#x} / reserved byte {reserved}")
    head = FrameHead(kind, flags, meta_len, corr, seq, payload_len)
    limit = max_frame if schema.packed == "raw" else max_control
    if head.size > limit:
        raise FrameTooLarge(f"{schema.cls.__name__} frame of {head.size} bytes exceeds the limit of {limit}")
    if not schema.packed and payload_len:
        raise FrameError(f"{schema.cls.__name__} carries no payload, got {payload_len} bytes")
    if schema.packed in _ITEM_SIZE and payload_len % _ITEM_SIZE[schema.packed]:
        raise FrameError(f"{schema.cls.__name__} payload of {payload_len} bytes is not whole items")
    return head


def parse_meta(head: FrameHead, meta: m.Buffer) -> dict:
    """orjson metadata -> dict with exactly the message's field names (values checked later)."""
    try:
        obj = orjson.loads(meta)
    except orjson.JSONDecodeError as e:
        raise FrameError(f"metadata is not valid JSON: {e}") from None
    if type(obj) is not dict:
        raise FrameError("metadata must be a JSON object")
    schema = _SCHEMAS[head.kind]
    if obj.keys() != schema.meta_fields:
        missing = sorted(schema.meta_fields - obj.keys())
        extra = sorted(obj.keys() - schema.meta_fields)
        raise FrameError(f"{schema.cls.__name__} metadata: missing {missing}, unknown {extra}")
    return obj


def kv_span(meta: dict) -> m.KVSpan:
    """The KVSpan of a KV chunk's metadata (validated), before its payload is read."""
    try:
        return m.KVSpan(meta["request_id"], meta["layer_start"], meta["layer_end"], meta["token_start"],
                        meta["token_end"], meta["dtype"], meta["shape"], meta["virtual"])
    except (ValueError, TypeError, OverflowError) as e:
        raise FrameError(f"KVChunk: {e}") from None


def build(head: FrameHead, meta: dict, payload: m.Buffer, span: m.KVSpan | None = None) -> m.Message:
    """Construct and validate the message of a frame whose metadata and payload are read."""
    schema = _SCHEMAS[head.kind]
    for name, sub in schema.nested:
        meta[name] = _from_json(sub, meta[name], f"{schema.cls.__name__}.{name}")
    try:
        if schema.packed == "raw":
            span = span or kv_span(meta)
            if len(payload) != span.payload_nbytes:
                raise FrameError(f"KVChunk payload has {len(payload)} bytes, span needs {span.payload_nbytes}")
            return m.KVChunk(span, payload, meta["seq"], meta["last"])
        if schema.packed == "batch":
            arr = array("i")
            arr.frombytes(payload)
            if _BIG_ENDIAN:
                arr.byteswap()
            return m.TokenBatch(_batch_items(meta, arr))
        if schema.packed:
            arr = array(schema.packed)
            arr.frombytes(payload)
            if _BIG_ENDIAN:
                arr.byteswap()
            return schema.cls(**meta, **{schema.packed_field: tuple(arr)})
        return schema.cls(**meta)
    except (ValueError, TypeError, OverflowError) as e:
        raise FrameError(f"{schema.cls.__name__}: {e}") from None


def decode(buf: m.Buffer, *, max_frame: int = MAX_U32, max_control: int = MAX_U32) -> Frame:
    """One whole frame -> Frame; raises FrameError for anything malformed.

    A KVChunk's payload is a memoryview into `buf` (no copy).
    """
    try:
        view = memoryview(buf).cast("B")
    except (TypeError, ValueError) as e:
        raise FrameError(f"not a byte buffer: {e}") from None
    head = parse_head(view, max_frame=max_frame, max_control=max_control)
    if len(view) != head.size:
        raise FrameError(f"frame has {len(view)} bytes, header says {head.size}")
    meta_end = HEADER_SIZE + head.meta_len
    meta = parse_meta(head, view[HEADER_SIZE:meta_end])
    return Frame(head, build(head, meta, view[meta_end:]))
