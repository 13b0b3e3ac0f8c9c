"""A numpy reference of the segmented checksum (:mod:`kvstore._segsum`), written from
the XXH3-64 specification and not through the C library, so that a test can hold the
C-backed host path (and the CUDA kernel, which follows the same steps) against it.

XXH3's long path (inputs over 240 bytes) is vectorised over segments *and* over the
stripes of each 1 KiB block: inside a block the eight 64-bit accumulators only add, so a
block's contribution is one sum, and only the scramble between blocks is sequential
(that is also how :mod:`kvstore._segsum_cuda` splits the work). Inputs of at most 240
bytes (a short payload, a short list of segment digests) take XXH3's short paths, in
plain Python integers. Slow next to the C path; for tests and cross-checks only.
"""

from __future__ import annotations

import numpy as np

from kvstore._segsum import (ACC_INIT, BLOCK_BYTES, LONG_MIN_BYTES, PRIME32_1, PRIME64_1, PRIME64_2, PRIME64_3,
                             PRIME_MX1, PRIME_MX2, SECRET, STRIPE_BYTES, STRIPES_PER_BLOCK, long_path_keys,
                             segment_spans)

_M64 = (1 << 64) - 1
_M32 = np.uint64(0xFFFFFFFF)
_SWAP = [1, 0, 3, 2, 5, 4, 7, 6]   # lane i also adds the raw word of lane i ^ 1


def reference_checksum(payload) -> int:
    """The segmented checksum of ``payload``, computed from the specification."""
    data = np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)
    digests = reference_digests(data)
    if len(digests) == 1:
        return digests[0]
    return xxh3_64(np.array(digests, dtype="<u8").view(np.uint8))


def reference_digests(data: np.ndarray) -> list[int]:
    """XXH3-64 of each segment of the ``uint8`` array ``data``; the equal-length
    segments in one vectorised pass, the last (longer) one in another."""
    spans = segment_spans(data.nbytes)
    if len(spans) == 1:
        return [xxh3_64(data)]
    body = data[:spans[-1][0]].reshape(len(spans) - 1, -1)
    return long_path(body).tolist() + long_path(data[spans[-1][0]:].reshape(1, -1)).tolist()


def xxh3_64(data: np.ndarray) -> int:
    """XXH3-64 (seed 0) of a ``uint8`` array."""
    if data.nbytes >= LONG_MIN_BYTES:
        return int(long_path(data.reshape(1, -1))[0])
    return _short(bytes(data))


def long_path(rows: np.ndarray) -> np.ndarray:
    """XXH3-64 of each row of a ``(m, L)`` ``uint8`` array, ``L > 240``; ``uint64[m]``."""
    m, n = rows.shape
    keys = long_path_keys()
    blocks = (n - 1) // BLOCK_BYTES
    words = np.ascontiguousarray(rows[:, :blocks * BLOCK_BYTES]).view("<u8").reshape(m, blocks, STRIPES_PER_BLOCK, 8)
    sums = _stripe_terms(words, keys["stripe"]).sum(axis=2, dtype=np.uint64)   # (m, blocks, 8)
    acc = np.tile(np.array(ACC_INIT, dtype=np.uint64), (m, 1))
    for b in range(blocks):
        acc = acc + sums[:, b]
        acc = ((acc ^ (acc >> np.uint64(47))) ^ keys["scramble"]) * np.uint64(PRIME32_1)
    start = blocks * BLOCK_BYTES
    stripes = (n - 1 - start) // STRIPE_BYTES
    tail = np.ascontiguousarray(rows[:, start:start + stripes * STRIPE_BYTES]).view("<u8").reshape(m, stripes, 8)
    acc = acc + _stripe_terms(tail, keys["stripe"][:stripes]).sum(axis=1, dtype=np.uint64)
    last = np.ascontiguousarray(rows[:, n - STRIPE_BYTES:]).view("<u8")
    acc = acc + _stripe_terms(last, keys["last"])
    merged = np.full(m, (n * PRIME64_1) & _M64, dtype=np.uint64)
    for i in range(0, 8, 2):
        merged = merged + _mul128_fold64(acc[:, i] ^ keys["merge"][i], acc[:, i + 1] ^ keys["merge"][i + 1])
    merged = (merged ^ (merged >> np.uint64(37))) * np.uint64(PRIME_MX1)
    return merged ^ (merged >> np.uint64(32))


def _stripe_terms(words: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """What each stripe adds to each lane: the 32x32-bit product of the keyed word plus
    the raw word of the neighbouring lane (``words[..., 8]``, ``keys`` broadcast)."""
    keyed = words ^ keys
    return (keyed & _M32) * (keyed >> np.uint64(32)) + words[..., _SWAP]


def _mul128_fold64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Low 64 bits XOR high 64 bits of the 128-bit products ``a * b`` (element-wise)."""
    a_lo, a_hi, b_lo, b_hi = a & _M32, a >> np.uint64(32), b & _M32, b >> np.uint64(32)
    lo_lo, hi_lo, lo_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi
    cross = (lo_lo >> np.uint64(32)) + (hi_lo & _M32) + lo_hi
    upper = (hi_lo >> np.uint64(32)) + (cross >> np.uint64(32)) + a_hi * b_hi
    lower = (cross << np.uint64(32)) | (lo_lo & _M32)
    return lower ^ upper


# -- XXH3's paths for at most 240 bytes, in Python integers --------------------------------

def _r64(buf: bytes, at: int) -> int:
    return int.from_bytes(buf[at:at + 8], "little")


def _r32(buf: bytes, at: int) -> int:
    return int.from_bytes(buf[at:at + 4], "little")


def _fold(a: int, b: int) -> int:
    p = a * b
    return (p & _M64) ^ (p >> 64)


def _avalanche(h: int) -> int:
    h ^= h >> 37
    h = (h * PRIME_MX1) & _M64
    return h ^ (h >> 32)


def _xxh64_avalanche(h: int) -> int:
    h ^= h >> 33
    h = (h * PRIME64_2) & _M64
    h ^= h >> 29
    h = (h * PRIME64_3) & _M64
    return h ^ (h >> 32)


def _mix16(buf: bytes, at: int, key_at: int) -> int:
    return _fold(_r64(buf, at) ^ _r64(SECRET, key_at), _r64(buf, at + 8) ^ _r64(SECRET, key_at + 8))


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M64


def _short(buf: bytes) -> int:
    n = len(buf)
    if n == 0:
        return _xxh64_avalanche(_r64(SECRET, 56) ^ _r64(SECRET, 64))
    if n <= 3:
        combined = (buf[0] << 16) | (buf[n >> 1] << 24) | buf[n - 1] | (n << 8)
        return _xxh64_avalanche(combined ^ (_r32(SECRET, 0) ^ _r32(SECRET, 4)))
    if n <= 8:
        keyed = ((_r32(buf, n - 4) + (_r32(buf, 0) << 32)) ^ (_r64(SECRET, 8) ^ _r64(SECRET, 16))) & _M64
        keyed ^= _rotl(keyed, 49) ^ _rotl(keyed, 24)
        keyed = (keyed * PRIME_MX2) & _M64
        keyed ^= (keyed >> 35) + n
        keyed = (keyed * PRIME_MX2) & _M64
        return keyed ^ (keyed >> 28)
    if n <= 16:
        lo = _r64(buf, 0) ^ (_r64(SECRET, 24) ^ _r64(SECRET, 32))
        hi = _r64(buf, n - 8) ^ (_r64(SECRET, 40) ^ _r64(SECRET, 48))
        swapped = int.from_bytes(lo.to_bytes(8, "little"), "big")
        return _avalanche((n + swapped + hi + _fold(lo, hi)) & _M64)
    acc = n * PRIME64_1
    if n <= 128:
        for i in range((n - 1) // 32, -1, -1):   # pairs from the outside in, as XXH3 reads them
            acc += _mix16(buf, 16 * i, 32 * i) + _mix16(buf, n - 16 * (i + 1), 32 * i + 16)
        return _avalanche(acc & _M64)
    for i in range(8):
        acc += _mix16(buf, 16 * i, 16 * i)
    end = _mix16(buf, n - 16, 136 - 17)
    acc = _avalanche(acc & _M64)
    for i in range(8, n // 16):
        end += _mix16(buf, 16 * i, 16 * (i - 8) + 3)
    return _avalanche((acc + end) & _M64)


__all__ = ["long_path", "reference_checksum", "reference_digests", "xxh3_64"]
