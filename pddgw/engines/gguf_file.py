"""A GGUF file's metadata and tensor table, read with `struct`; its tensors as views of a memory map.

Why not `gguf.GGUFReader`: it turns every part of every metadata value into numpy views
before anything can be read, ~98 K strings for SmolLM2's vocabulary and merges: 2.1-2.4 s
and +159 MB while it lives, and `pddgw serve` needed it twice (metadata, then weights),
~4.7 s of its 8.5 s start-up.  Here the metadata is a dict of plain values (what
`ReaderField.contents()` gives: int, float, bool, str, lists of them) and each tensor's
`data` is what `GGUFReader` gives for it (element dtype for F16 / F32 / F64 / integer
types, else bytes shaped by `quant_shape_to_byte_shape`), for `gguf.quants.dequantize`.

Contract: GGUF versions 2 and 3, little-endian; every count and length is checked against
the file's size before it is read, and a file that is not a well-formed GGUF raises
ValueError saying where it stops making sense.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
            GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
            GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
            GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
_ELEMENT_DTYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                   GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                   GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                   GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True, slots=True)
class GgufTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]                  # GGUF's order: innermost dimension first
    data: np.ndarray                        # read-only view of the file (module docstring)


@dataclass(frozen=True, slots=True)
class GgufFile:
    fields: dict[str, Any]
    tensors: list[GgufTensor]


def read(path: str | Path) -> GgufFile:
    """The metadata and tensor table of a GGUF file; ValueError where it is not well formed."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm))
    if cur.take(4) != _MAGIC:
        raise ValueError("no GGUF magic")
    version = cur.scalar("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} unsupported (2 or 3)")
    n_tensors, n_fields = cur.scalar("Q"), cur.scalar("Q")
    fields = {}
    for _ in range(cur.count(n_fields, 12)):
        key = cur.string()
        if key in fields:
            raise ValueError(f"metadata key {key!r} twice")
        fields[key] = cur.value(GGUFValueType(cur.scalar("I")))
    table = [_tensor_info(cur) for _ in range(cur.count(n_tensors, 24))]
    if len({name for name, *_ in table}) != len(table):
        raise ValueError("a tensor name twice")
    align = int(fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    if align <= 0:
        raise ValueError(f"general.alignment {align} is not positive")
    start = -(-cur.pos // align) * align
    tensors = []
    for name, dims, kind, offset in table:
        block, type_size = GGML_QUANT_SIZES[kind]
        n = math.prod(dims)
        a = start + offset
        b = a + n * type_size // block
        if b > mm.size:
            raise ValueError(f"tensor {name!r} ends at byte {b}, past the file's {mm.size}")
        np_dims = tuple(reversed(dims))
        dtype = _ELEMENT_DTYPES.get(kind)
        data = (mm[a:b].view(dtype).reshape(np_dims) if dtype is not None
                else mm[a:b].reshape(quant_shape_to_byte_shape(np_dims, kind)))
        tensors.append(GgufTensor(name, kind, dims, data))
    return GgufFile(fields, tensors)


def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cur.string()
    dims = tuple(cur.scalar("Q") for _ in range(cur.count(cur.scalar("I"), 8)))
    return name, dims, GGMLQuantizationType(cur.scalar("I")), cur.scalar("Q")


class _Cursor:
    """Little-endian reads from a buffer, each bounded by what is left of it."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if n > len(self.buf) - self.pos:
            raise ValueError(f"{n} bytes wanted at byte {self.pos}, past the file's end ({len(self.buf)})")
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def scalar(self, fmt: str) -> Any:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self, n: int, min_bytes: int) -> int:
        """`n` items of at least `min_bytes` each, checked against the bytes left."""
        if n * min_bytes > len(self.buf) - self.pos:
            raise ValueError(f"{n} items at byte {self.pos} cannot fit in the file ({len(self.buf)} bytes)")
        return n

    def string(self) -> str:
        return bytes(self.take(self.scalar("Q"))).decode("utf-8")

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind != GGUFValueType.ARRAY:
            return self.scalar(_SCALARS[kind])
        item, n = GGUFValueType(self.scalar("I")), self.scalar("Q")
        fmt = _SCALARS.get(item)
        if fmt is None:                          # strings or arrays: one by one
            return [self.value(item) for _ in range(self.count(n, 8))]
        return list(struct.unpack(f"<{n}{fmt}", self.take(n * struct.calcsize(fmt))))
