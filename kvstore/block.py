"""The self-describing block format of persistent and remote copies.

A stored block is ``HEADER_BYTES`` of header followed by the payload::

    offset size field
    0      4    magic  b"KVSB"
    4      2    format version (1)
    6      2    flags: 0, or FLAG_SEGMENTED (bit 0)
    8      8    payload length in bytes
    16     8    payload checksum: XXH3-64, or with FLAG_SEGMENTED the segmented checksum
    24     32   key digest
    56     8    header checksum: XXH3-64 of bytes 0..56

Format version 2 (``EXT_VERSION``) is the same 64 bytes with version 2, followed by a
64-byte extension that carries the key's parent digest, so a reader of the first
``EXT_HEADER_BYTES`` learns the block's place in its chain without any other request
(object stores keep it in the body instead of per-object metadata)::

    offset size field
    64     4    magic  b"KVSX"
    68     1    1 when the key has a parent, else 0
    69     3    zero
    72     32   parent digest (zero without a parent)
    104    16   zero
    120    8    extension checksum: XXH3-64 of bytes 64..120, seeded with the header
                checksum (bytes 56..64), so an extension only verifies with its own header

A block of version 2 has ``EXT_HEADER_BYTES`` of header before its payload. Readers
that only know version 1 (:func:`parse_header`) reject it as unsupported instead of
misplacing the payload.

``FLAG_SEGMENTED`` (either version) says the payload checksum is the segmented one of
:mod:`kvstore._segsum`: XXH3-64 of each 64 KiB segment (the last one takes the
remainder), and XXH3-64 of those digests as little-endian 64-bit integers when there is
more than one segment. A GPU computes it where the payload landed
(:mod:`kvstore._segsum_cuda`). Writers set it only when asked (the NVMe tier's
``device_verify``); readers accept both. Other flag bits are rejected as unsupported.

Encoding writes the header into a caller-supplied buffer; verifying reads it from one.
Neither copies the payload. All integers are little-endian.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from kvstore._segsum import segmented_checksum
from kvstore.errors import CorruptBlockError

MAGIC = b"KVSB"
VERSION = 1
HEADER_BYTES = 64
EXT_VERSION = 2
EXT_MAGIC = b"KVSX"
EXT_HEADER_BYTES = 128
FLAG_SEGMENTED = 0x1
KNOWN_FLAGS = FLAG_SEGMENTED
_HEAD = struct.Struct("<4sHHQQ32s")  # 56 bytes, then the header checksum
_CHECK = struct.Struct("<Q")
_EXT = struct.Struct("<4sB3x32s16x")  # 56 bytes, then the extension checksum


class BlockHeader(NamedTuple):
    """What a verified header says: format version, flags, payload length and checksum."""

    version: int
    flags: int
    length: int
    checksum: int


def checksum(payload, flags: int = 0) -> int:
    """The payload checksum of a buffer (bytes, memoryview, numpy array) for a block
    with ``flags``: XXH3-64, or the segmented checksum under :data:`FLAG_SEGMENTED`.
    Releases the GIL while hashing."""
    if flags & FLAG_SEGMENTED:
        return segmented_checksum(payload)
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(digest: bytes, payload, out, *, payload_checksum: int | None = None, flags: int = 0) -> int:
    """Write the header for ``payload`` (any contiguous buffer) into ``out[:HEADER_BYTES]``.

    ``out`` is a writable buffer owned by the caller. ``flags``: 0 or
    :data:`FLAG_SEGMENTED` (``payload_checksum``, when given, must be the matching
    kind). Returns the payload checksum so callers can index it without hashing twice.
    """
    return _encode_base(VERSION, digest, payload, out, payload_checksum, flags)


def encode_ext_header(digest: bytes, parent: bytes | None, payload, out, *,
                      payload_checksum: int | None = None, flags: int = 0) -> int:
    """Write a version-2 header (header + parent extension) for ``payload`` into
    ``out[:EXT_HEADER_BYTES]``; ``parent`` is the parent digest or ``None``. Returns the
    payload checksum."""
    if parent is not None and len(parent) != len(digest):
        raise ValueError(f"parent digest has {len(parent)} bytes, expected {len(digest)}")
    csum = _encode_base(EXT_VERSION, digest, payload, out, payload_checksum, flags)
    target = memoryview(out).cast("B")
    _EXT.pack_into(target, HEADER_BYTES, EXT_MAGIC, parent is not None, parent or bytes(len(digest)))
    seed = _CHECK.unpack_from(target, 56)[0]
    _CHECK.pack_into(target, 120, xxhash.xxh3_64_intdigest(target[HEADER_BYTES:120], seed))
    return csum


def _encode_base(version: int, digest: bytes, payload, out, payload_checksum: int | None, flags: int) -> int:
    if flags & ~KNOWN_FLAGS:
        raise ValueError(f"unknown block flags {flags:#x}")
    mv = memoryview(payload).cast("B")
    csum = checksum(mv, flags) if payload_checksum is None else payload_checksum
    target = memoryview(out).cast("B")
    _HEAD.pack_into(target, 0, MAGIC, version, flags, mv.nbytes, csum, digest)
    _CHECK.pack_into(target, 56, xxhash.xxh3_64_intdigest(target[:56]))
    return csum


def header_bytes(digest: bytes, payload) -> bytearray:
    """A fresh header for ``payload``; for callers that send header and payload apart."""
    out = bytearray(HEADER_BYTES)
    encode_header(digest, payload, out)
    return out


def parse_header(header, *, digest: bytes | None = None) -> tuple[int, int]:
    """Check a version-1 header's magic, version, header checksum and (when given) key
    digest. Returns ``(payload_length, payload_checksum)``; raises
    :class:`CorruptBlockError` (also for a version-2 block: its payload starts later).
    The checksum's kind is in the flags: readers that verify payloads use
    :func:`parse_block_header` instead.
    """
    head = parse_block_header(header, digest=digest)
    if head.version != VERSION:
        raise CorruptBlockError(f"unsupported block format version {head.version}")
    return head.length, head.checksum


def parse_any_header(header, *, digest: bytes | None = None) -> tuple[int, int, int]:
    """Check the first ``HEADER_BYTES`` of a block of either version. Returns
    ``(version, payload_length, payload_checksum)``; the header is ``HEADER_BYTES`` long
    for version 1 and ``EXT_HEADER_BYTES`` for version 2, whose extension the caller then
    checks with :func:`parse_extension`."""
    head = parse_block_header(header, digest=digest)
    return head.version, head.length, head.checksum


def parse_block_header(header, *, digest: bytes | None = None) -> BlockHeader:
    """Check the first ``HEADER_BYTES`` of a block of either version (magic, version,
    flags, header checksum and, when given, key digest); raises
    :class:`CorruptBlockError`. Verify the payload with ``checksum(payload, flags)``."""
    mv = memoryview(header).cast("B")
    if mv.nbytes < HEADER_BYTES:
        raise CorruptBlockError(f"block header truncated: {mv.nbytes} < {HEADER_BYTES} bytes")
    magic, version, flags, length, csum, key = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad block magic {magic!r}")
    if _CHECK.unpack_from(mv, 56)[0] != xxhash.xxh3_64_intdigest(mv[:56]):
        raise CorruptBlockError("block header checksum mismatch")
    if version not in (VERSION, EXT_VERSION) or flags & ~KNOWN_FLAGS:
        raise CorruptBlockError(f"unsupported block format version {version} (flags {flags:#x})")
    if digest is not None and key != digest:
        raise CorruptBlockError("block belongs to another key (digest mismatch)")
    return BlockHeader(version, flags, length, csum)


def header_size(version: int) -> int:
    """Bytes of header before the payload in a block of ``version``."""
    return EXT_HEADER_BYTES if version == EXT_VERSION else HEADER_BYTES


def parse_extension(header) -> bytes | None:
    """Verify the extension of a version-2 block whose first ``HEADER_BYTES`` already
    passed :func:`parse_any_header`; ``header`` holds its first ``EXT_HEADER_BYTES``.
    Returns the parent digest, or ``None`` for a first chunk; raises
    :class:`CorruptBlockError`."""
    mv = memoryview(header).cast("B")
    if mv.nbytes < EXT_HEADER_BYTES:
        raise CorruptBlockError(f"block header extension truncated: {mv.nbytes} < {EXT_HEADER_BYTES} bytes")
    seed = _CHECK.unpack_from(mv, 56)[0]
    if _CHECK.unpack_from(mv, 120)[0] != xxhash.xxh3_64_intdigest(mv[HEADER_BYTES:120], seed):
        raise CorruptBlockError("block header extension checksum mismatch")
    magic, has_parent, parent = _EXT.unpack_from(mv, HEADER_BYTES)
    if magic != EXT_MAGIC or has_parent not in (0, 1):
        raise CorruptBlockError(f"bad block header extension (magic {magic!r}, parent flag {has_parent})")
    return parent if has_parent else None


def verify(digest: bytes, block, *, payload_length: int | None = None) -> memoryview:
    """Verify a whole stored block (header + payload) of either version and either
    checksum kind, held in ``block``.

    Returns a view of the verified payload inside ``block`` (no copy). Raises
    :class:`CorruptBlockError` when anything differs from what the header promises.
    """
    mv = memoryview(block).cast("B")
    head = parse_block_header(mv, digest=digest)
    if head.version == EXT_VERSION:
        parse_extension(mv)
    start, length = header_size(head.version), head.length
    if payload_length is not None and length != payload_length:
        raise CorruptBlockError(f"block length {length} differs from expected {payload_length}")
    if mv.nbytes < start + length:
        raise CorruptBlockError(f"block truncated: {mv.nbytes - start} of {length} payload bytes")
    payload = mv[start:start + length]
    if checksum(payload, head.flags) != head.checksum:
        raise CorruptBlockError("block payload checksum mismatch")
    return payload


def verify_payload(payload, length: int, csum: int, flags: int = 0) -> None:
    """Verify a payload read apart from its header (header already parsed; ``flags``
    are its flags)."""
    mv = memoryview(payload).cast("B")
    if mv.nbytes != length:
        raise CorruptBlockError(f"payload length {mv.nbytes} differs from header's {length}")
    if checksum(mv, flags) != csum:
        raise CorruptBlockError("block payload checksum mismatch")


__all__ = ["EXT_HEADER_BYTES", "EXT_MAGIC", "EXT_VERSION", "FLAG_SEGMENTED", "HEADER_BYTES", "KNOWN_FLAGS", "MAGIC",
           "VERSION", "BlockHeader", "checksum", "encode_ext_header", "encode_header", "header_bytes", "header_size",
           "parse_any_header", "parse_block_header", "parse_extension", "parse_header", "verify", "verify_payload"]
