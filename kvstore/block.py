"""The self-describing block format of persistent and remote copies.

A stored block is ``HEADER_BYTES`` of header followed by the payload::

    offset size field
    0      4    magic  b"KVSB"
    4      2    format version (1)
    6      2    flags (0)
    8      8    payload length in bytes
    16     8    payload checksum: XXH3-64
    24     32   key digest
    56     8    header checksum: XXH3-64 of bytes 0..56

Encoding writes the header into a caller-supplied buffer; verifying reads it from one.
Neither copies the payload. All integers are little-endian.
"""

from __future__ import annotations

import struct

import xxhash

from kvstore.errors import CorruptBlockError

MAGIC = b"KVSB"
VERSION = 1
HEADER_BYTES = 64
_HEAD = struct.Struct("<4sHHQQ32s")  # 56 bytes, then the header checksum
_CHECK = struct.Struct("<Q")


def checksum(payload) -> int:
    """XXH3-64 of a buffer (bytes, memoryview, numpy array); releases the GIL."""
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(digest: bytes, payload, out, *, payload_checksum: int | None = None) -> int:
    """Write the header for ``payload`` (any contiguous buffer) into ``out[:HEADER_BYTES]``.

    ``out`` is a writable buffer owned by the caller. Returns the payload checksum so
    callers can index it without hashing twice.
    """
    mv = memoryview(payload).cast("B")
    csum = checksum(mv) if payload_checksum is None else payload_checksum
    target = memoryview(out).cast("B")
    _HEAD.pack_into(target, 0, MAGIC, VERSION, 0, mv.nbytes, csum, digest)
    _CHECK.pack_into(target, 56, xxhash.xxh3_64_intdigest(target[:56]))
    return csum


def header_bytes(digest: bytes, payload) -> bytearray:
    """A fresh header for ``payload``; for callers that send header and payload apart."""
    out = bytearray(HEADER_BYTES)
    encode_header(digest, payload, out)
    return out


def parse_header(header, *, digest: bytes | None = None) -> tuple[int, int]:
    """Check a header's magic, version, header checksum and (when given) key digest.

    Returns ``(payload_length, payload_checksum)``; raises :class:`CorruptBlockError`.
    """
    mv = memoryview(header).cast("B")
    if mv.nbytes < HEADER_BYTES:
        raise CorruptBlockError(f"block header truncated: {mv.nbytes} < {HEADER_BYTES} bytes")
    magic, version, _flags, length, csum, key = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad block magic {magic!r}")
    if _CHECK.unpack_from(mv, 56)[0] != xxhash.xxh3_64_intdigest(mv[:56]):
        raise CorruptBlockError("block header checksum mismatch")
    if version != VERSION:
        raise CorruptBlockError(f"unsupported block format version {version}")
    if digest is not None and key != digest:
        raise CorruptBlockError("block belongs to another key (digest mismatch)")
    return length, csum


def verify(digest: bytes, block, *, payload_length: int | None = None) -> memoryview:
    """Verify a whole stored block (header + payload) held in ``block``.

    Returns a view of the verified payload inside ``block`` (no copy). Raises
    :class:`CorruptBlockError` when anything differs from what the header promises.
    """
    mv = memoryview(block).cast("B")
    length, csum = parse_header(mv, digest=digest)
    if payload_length is not None and length != payload_length:
        raise CorruptBlockError(f"block length {length} differs from expected {payload_length}")
    if mv.nbytes < HEADER_BYTES + length:
        raise CorruptBlockError(f"block truncated: {mv.nbytes - HEADER_BYTES} of {length} payload bytes")
    payload = mv[HEADER_BYTES:HEADER_BYTES + length]
    if checksum(payload) != csum:
        raise CorruptBlockError("block payload checksum mismatch")
    return payload


def verify_payload(payload, length: int, csum: int) -> None:
    """Verify a payload read apart from its header (header already parsed)."""
    mv = memoryview(payload).cast("B")
    if mv.nbytes != length:
        raise CorruptBlockError(f"payload length {mv.nbytes} differs from header's {length}")
    if checksum(mv) != csum:
        raise CorruptBlockError("block payload checksum mismatch")


__all__ = ["HEADER_BYTES", "MAGIC", "VERSION", "checksum", "encode_header", "header_bytes",
           "parse_header", "verify", "verify_payload"]
