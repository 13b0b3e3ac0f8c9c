"""The segmented payload checksum: XXH3-64 per 64 KiB segment, combined (host path).

A payload of ``n`` bytes is cut into ``k = max(1, n // SEGMENT_BYTES)`` segments:
segment ``i < k - 1`` is bytes ``[i*S, (i+1)*S)``, the last one runs from ``(k-1)*S`` to
``n`` (so, once ``n >= S``, every segment holds ``S`` to ``2S - 1`` bytes). Each segment
is hashed with XXH3-64 (seed 0, default secret): ``d_0 .. d_{k-1}``. The checksum is

- ``d_0`` when ``k == 1`` (payloads under ``2*S``: the same value as plain XXH3-64), else
- XXH3-64 of ``d_0 .. d_{k-1}`` written as ``k`` little-endian 64-bit integers.

Why this shape: segments are independent, so a GPU hashes them in parallel (and, inside
a segment, XXH3's eight lanes and the sixteen stripes of each 1 KiB block too, see
:mod:`kvstore._segsum_cuda`); every segment of a multi-segment payload is longer than 240
bytes, so the device only needs XXH3's long-input path; and the host hashes each segment
with the C library (``xxhash``), one call per 64 KiB, which keeps it near plain XXH3-64.

This module also derives from XXH3's default secret the 64-bit keys the long path uses,
for the numpy reference (:mod:`kvstore._segsum_ref`) and the CUDA kernel to share.
Everything here is pure and thread-safe.
"""

from __future__ import annotations

import sys
from array import array

import numpy as np
import xxhash

SEGMENT_BYTES = 64 << 10
_BIG_ENDIAN = sys.byteorder != "little"
_h = xxhash.xxh3_64_intdigest


def segment_count(nbytes: int) -> int:
    """Number of segments of a payload of ``nbytes``."""
    return max(1, nbytes // SEGMENT_BYTES)


def segment_spans(nbytes: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each segment of a payload of ``nbytes``, in order."""
    k = segment_count(nbytes)
    starts = [i * SEGMENT_BYTES for i in range(k)]
    return [(s, s + SEGMENT_BYTES) for s in starts[:-1]] + [(starts[-1], nbytes)]


def segment_digests(payload) -> array:
    """XXH3-64 of each segment of ``payload`` (any contiguous buffer), as ``array('Q')``."""
    mv = memoryview(payload).cast("B")
    n = mv.nbytes
    last = (segment_count(n) - 1) * SEGMENT_BYTES
    out = array("Q", [_h(mv[i:i + SEGMENT_BYTES]) for i in range(0, last, SEGMENT_BYTES)])
    out.append(_h(mv[last:]))
    return out


def combine(digests) -> int:
    """The checksum from the segment digests (a sequence of ints or a ``uint64`` array)."""
    if len(digests) == 1:
        return int(digests[0])
    return _h(np.asarray(digests, dtype="<u8").tobytes())


def segmented_checksum(payload) -> int:
    """The segmented checksum of ``payload`` (any contiguous buffer); releases the GIL
    while hashing each segment."""
    n = payload.nbytes if type(payload) is np.ndarray else memoryview(payload).nbytes
    if n < 2 * SEGMENT_BYTES:
        return _h(payload)   # one segment: its digest is the checksum
    mv = memoryview(payload).cast("B")
    last = (n // SEGMENT_BYTES - 1) * SEGMENT_BYTES   # segment_digests, inlined: this is the hot path
    digests = array("Q", [_h(mv[i:i + SEGMENT_BYTES]) for i in range(0, last, SEGMENT_BYTES)])
    digests.append(_h(mv[last:]))
    if _BIG_ENDIAN:
        digests.byteswap()
    return _h(digests)


# -- XXH3 long-path constants (XXH3 0.8 specification), shared with the reference and kernel --

PRIME32_1 = 0x9E3779B1
PRIME32_2 = 0x85EBCA77
PRIME32_3 = 0xC2B2AE3D
PRIME64_1 = 0x9E3779B185EBCA87
PRIME64_2 = 0xC2B2AE3D27D4EB4F
PRIME64_3 = 0x165667B19E3779F9
PRIME64_4 = 0x85EBCA77C2B2AE63
PRIME64_5 = 0x27D4EB2F165667C5
PRIME_MX1 = 0x165667919E3779F9
PRIME_MX2 = 0x9FB21C651E98DF25
ACC_INIT = (PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1)
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
STRIPE_BYTES = 64
STRIPES_PER_BLOCK = (len(SECRET) - STRIPE_BYTES) // 8   # 16
BLOCK_BYTES = STRIPE_BYTES * STRIPES_PER_BLOCK           # 1024
LONG_MIN_BYTES = 241   # XXH3-64 takes its long path above 240 bytes


def secret_u64(offset: int, count: int) -> np.ndarray:
    """``count`` little-endian 64-bit words of the secret from byte ``offset`` (unaligned)."""
    return np.frombuffer(SECRET, dtype="<u8", count=count, offset=offset).astype(np.uint64)


def long_path_keys() -> dict[str, np.ndarray]:
    """The secret words the long path reads: ``stripe`` (16 x 8: stripe ``s`` lane ``i``
    reads ``secret[8s + 8i]``), ``scramble`` (8, after each 1 KiB block), ``last`` (8,
    for the final stripe) and ``merge`` (8, for the final merge)."""
    return {"stripe": np.stack([secret_u64(8 * s, 8) for s in range(STRIPES_PER_BLOCK)]),
            "scramble": secret_u64(len(SECRET) - STRIPE_BYTES, 8),
            "last": secret_u64(len(SECRET) - STRIPE_BYTES - 7, 8),
            "merge": secret_u64(11, 8)}


__all__ = ["SEGMENT_BYTES", "combine", "long_path_keys", "segment_count", "segment_digests", "segment_spans",
           "segmented_checksum"]
