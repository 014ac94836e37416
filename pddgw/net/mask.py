"""RFC 6455 masking (XOR with a 4-byte key) on arbitrary buffers, vectorised.

aiohttp's own mask works only on bytearrays; KV payloads land in caller memory
(memoryviews of tensors), so unmasking happens in place there, 8 bytes a lane.
"""

from __future__ import annotations

import numpy as np


def _key64(key: bytes, phase: int) -> np.ndarray:
    k = key[phase % 4:] + key[:phase % 4]
    return np.frombuffer(k * 2, dtype=np.uint64)


def _xor(src: memoryview, dst: memoryview, key: bytes, phase: int) -> None:
    n = len(src)
    if n == 0:
        return
    s8 = np.frombuffer(src, dtype=np.uint8)
    d8 = np.frombuffer(dst, dtype=np.uint8)
    n8 = n - n % 8
    if n8:
        np.bitwise_xor(s8[:n8].view(np.uint64), _key64(key, phase), out=d8[:n8].view(np.uint64))
    if n8 < n:
        tail = np.frombuffer((key[phase % 4:] + key[:phase % 4]) * 2, dtype=np.uint8)[: n - n8]
        np.bitwise_xor(s8[n8:], tail, out=d8[n8:])


def unmask_inplace(buf: memoryview, key: bytes, phase: int = 0) -> None:
    """XOR writable `buf` with `key`, where buf[0] is byte `phase` of the masked payload."""
    _xor(buf, buf, key, phase)


def masked_copy(src: memoryview, key: bytes, phase: int = 0) -> bytearray:
    """A masked copy of `src` (one pass: the copy and the XOR are the same loop)."""
    out = bytearray(len(src))
    _xor(src, memoryview(out), key, phase)
    return out
