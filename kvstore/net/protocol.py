"""The kvstore wire format (see ``docs/protocol.md``): frame headers and operation bodies.

Pure functions over buffers: no sockets, no Store. The server and the client both use
them, and the fuzz tests drive them with arbitrary bytes. Anything malformed raises
:class:`~kvstore.errors.ProtocolError` naming the problem; nothing else escapes.

A frame is a 24-byte header, ``body_len`` bytes of control body, then ``payload_len``
bytes of bulk payload (block bytes, back to back). All integers are little-endian.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvstore._wait import MAX_WAIT_S
from kvstore.errors import InvalidArgumentError, ProtocolError
from kvstore.hint import Hint
from kvstore.keys import KEY_WIRE_BYTES, BlockKey, _trusted

MAGIC = b"KV"
VERSION = 3
HEADER = struct.Struct("<2sBBIIIQ")  # magic, version, op, request id, status, body len, payload len
HEADER_BYTES = HEADER.size           # 24
_U32 = struct.Struct("<I")
_LOOKUP = struct.Struct("<dI")
_LOOKUP_WAIT = struct.Struct("<dd")   # lease_s, wait_s (then the keys)
_U64 = struct.Struct("<Q")
_COMMIT = struct.Struct("<QBI")  # reservation id, 1 = commit / 0 = abort, count of checksums that follow
_ZERO = bytes(32)
_NS_BYTES = 32     # a namespace digest
MISS = -1          # GET reply size: not stored
SIZE_MISMATCH = -2  # GET reply size: stored with another size than the caller's buffer

# Record layouts of batch bodies (numpy views, so a 4096-key batch parses without a loop).
# A record that carries block bytes carries their XXH3-64 (``kvstore.block.checksum``),
# computed by the sender before the bytes left: the receiver verifies before it stores
# or reports a block. New fields go at the end of a record (and the version goes up).
SIZED = np.dtype([("key", f"V{KEY_WIRE_BYTES}"), ("nbytes", "<u8")])
PUT_REC = np.dtype([("key", f"V{KEY_WIRE_BYTES}"), ("nbytes", "<u8"), ("checksum", "<u8")])
STAGED = np.dtype([("key", f"V{KEY_WIRE_BYTES}"), ("nbytes", "<u8"), ("offset", "<u8"), ("checksum", "<u8")])
SUMMED = np.dtype([("nbytes", "<i8"), ("checksum", "<u8")])  # GET / NIXL_GET reply, per key
PLACED = np.dtype([("nbytes", "<i8"), ("offset", "<u8"), ("checksum", "<u8"), ("where", "u1")])
WHERE_ARENA, WHERE_STAGING, WHERE_SOCKET = 0, 1, 2
NOT_SENT = -3       # NIXL_GET reply size: stored in a slower tier; fetch it with GET
PRESENT = -4        # SHM_RESERVE reply size: already stored, nothing to write
NIXL_REC = np.dtype([("key", f"V{KEY_WIRE_BYTES}"), ("nbytes", "<u8"), ("addr", "<u8"), ("checksum", "<u8")])
_NIXL_HEAD = struct.Struct("<BxxxI")  # memory kind (0 host, 1 GPU), device id
MAX_FIELD = 1 << 40   # largest block size or offset a record may carry (1 TiB; x 2**23 records < 2**64)


class Op(enum.IntEnum):
    HELLO = 1       # JSON handshake; must be the first frame
    PING = 2
    LOOKUP = 3      # lease_s, keys -> prefix length
    CONTAINS = 4    # keys -> one byte per key
    DELETE = 5      # keys -> count
    RELEASE = 6     # keys -> (drop lookup leases)
    GET = 7         # (key, nbytes)* -> sizes, payload
    PUT = 8         # (key, nbytes)* + payload -> one byte per key
    STATS = 9       # -> JSON
    SHM_ATTACH = 10  # staging path, size -> (same-host clients only)
    SHM_GET = 11    # (key, nbytes)* -> lease id, (nbytes, offset, where)*
    SHM_PUT = 12    # (key, nbytes, staging offset)* -> one byte per key
    SHM_DONE = 13   # lease id; no reply
    NIXL_HELLO = 14  # client NIXL agent metadata -> server NIXL agent metadata
    NIXL_GET = 15    # mem kind, device, (key, nbytes, client address)* -> sizes (server WRITEs)
    NIXL_PUT = 16    # mem kind, device, (key, nbytes, client address)* -> one byte per key (server READs)
    SHM_RESERVE = 24  # (key, nbytes)* -> reservation id, (nbytes, offset, where)* (client writes the arena)
    SHM_COMMIT = 25   # reservation id, commit/abort -> one byte per key
    CLEAR = 26        # namespace digests (none: all) -> u64 blocks removed
    HINT = 27         # retention hint, keys -> u32 cached blocks hinted
    LOOKUP_WAIT = 28  # lease_s, wait_s, keys -> prefix length, once all are stored or wait_s passed


NO_REPLY = frozenset({Op.SHM_DONE})


class Status(enum.IntEnum):
    OK = 0
    PROTOCOL = 1     # malformed frame; the connection is closed after this reply
    AUTH = 2         # missing or wrong token; closed
    TOO_LARGE = 3    # over a configured limit; closed
    INVALID = 4      # bad arguments (duplicate keys, bad offsets)
    BUFFER_SIZE = 5  # a caller buffer differs from the stored block
    BUSY = 6         # per-client limit reached; retry later
    UNAVAILABLE = 7  # shutting down or not supported here
    INTERNAL = 8


@dataclass(frozen=True)
class Limits:
    """Bounds enforced on every frame before any of its body or payload is read."""

    max_frame_bytes: int = 256 << 20
    max_batch: int = 4096

    @property
    def max_body_bytes(self) -> int:
        return 16 + self.max_batch * max(STAGED.itemsize, NIXL_REC.itemsize) + 4096


@dataclass(frozen=True)
class Header:
    op: int
    request_id: int
    status: int
    body_len: int
    payload_len: int


def pack_header(op: int, request_id: int, body_len: int = 0, payload_len: int = 0,
                status: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, request_id & 0xFFFFFFFF, status, body_len, payload_len)


def parse_header(buf: Any, limits: Limits, *, reply: bool = False) -> Header:
    """Validate a 24-byte header: magic, version, opcode, and every length against
    ``limits`` (so an oversize frame is refused before its body is read)."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes < HEADER_BYTES:
        raise ProtocolError(f"truncated frame header: {mv.nbytes} of {HEADER_BYTES} bytes")
    magic, version, op, rid, status, body_len, payload_len = HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r} (not a kvstore client?)")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    if op not in Op._value2member_map_:
        raise ProtocolError(f"unknown opcode {op}")
    if not reply and status:
        raise ProtocolError(f"request carries status {status}; only replies do")
    if body_len > limits.max_body_bytes and not reply:
        raise ProtocolError(f"body of {body_len} bytes exceeds the limit of {limits.max_body_bytes}")
    if body_len + payload_len > limits.max_frame_bytes:
        raise ProtocolError(f"frame of {body_len + payload_len} bytes exceeds max_frame_bytes "
                            f"{limits.max_frame_bytes}")
    return Header(op, rid, status, body_len, payload_len)


# -- bodies --------------------------------------------------------------------------------

def encode_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), default=str).encode()


def decode_json(body: Any) -> Any:
    try:
        value = json.loads(bytes(body).decode())
        json.dumps(value, ensure_ascii=False).encode("utf-8")   # lone surrogates fail here, not later
    except (UnicodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"body is not valid JSON: {type(exc).__name__}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"JSON body must be an object, got {type(value).__name__}")
    return value


def encode_keys(keys: Sequence[BlockKey]) -> bytes:
    return _U32.pack(len(keys)) + b"".join(k.to_bytes() for k in keys)


def _count(body: memoryview, record: int, limits: Limits, offset: int = 0) -> int:
    if body.nbytes < offset + 4:
        raise ProtocolError(f"body of {body.nbytes} bytes is too short for a batch count")
    (n,) = _U32.unpack_from(body, offset)
    if n > limits.max_batch:
        raise ProtocolError(f"batch of {n} keys exceeds max_batch {limits.max_batch}")
    if body.nbytes != offset + 4 + n * record:
        raise ProtocolError(f"body of {body.nbytes} bytes does not hold {n} records of {record} bytes")
    return n


def _keys_from(raw: np.ndarray) -> list[BlockKey]:
    # One copy of the key column, then slices of it. The fields are 32-byte slices by
    # construction, so the keys skip BlockKey's validation (this runs for every block
    # of every batch on the server's event loop).
    data, zero = raw.tobytes(), _ZERO
    out = []
    for o in range(0, len(data), KEY_WIRE_BYTES):
        parent, ns = data[o + 32:o + 64], data[o + 64:o + 96]
        out.append(_trusted(data[o:o + 32], None if parent == zero else parent, None if ns == zero else ns))
    return out


def decode_keys(body: Any, limits: Limits, offset: int = 0) -> list[BlockKey]:
    mv = memoryview(body).cast("B")
    n = _count(mv, KEY_WIRE_BYTES, limits, offset)
    raw = np.frombuffer(mv, dtype=f"V{KEY_WIRE_BYTES}", count=n, offset=offset + 4)
    return _keys_from(raw)


def encode_namespaces(namespaces: Sequence[bytes]) -> bytes:
    if any(len(ns) != _NS_BYTES for ns in namespaces):
        raise ProtocolError(f"a namespace digest is {_NS_BYTES} bytes")
    return _U32.pack(len(namespaces)) + b"".join(bytes(ns) for ns in namespaces)


def decode_namespaces(body: Any, limits: Limits) -> list[bytes]:
    mv = memoryview(body).cast("B")
    n = _count(mv, _NS_BYTES, limits)
    return [bytes(mv[4 + i * _NS_BYTES:4 + (i + 1) * _NS_BYTES]) for i in range(n)]


def encode_lookup(keys: Sequence[BlockKey], lease_s: float | None) -> bytes:
    return _LOOKUP.pack(float(lease_s or 0.0), len(keys)) + b"".join(k.to_bytes() for k in keys)


def decode_lookup(body: Any, limits: Limits) -> tuple[float | None, list[BlockKey]]:
    mv = memoryview(body).cast("B")
    if mv.nbytes < 8:
        raise ProtocolError("lookup body too short")
    (lease_s,) = struct.unpack_from("<d", mv, 0)
    if not (lease_s == lease_s) or lease_s < 0 or lease_s > 86400:  # NaN, negative, absurd
        raise ProtocolError(f"lookup lease of {lease_s} s is out of range [0, 86400]")
    return (lease_s or None), decode_keys(mv, limits, offset=8)


def encode_lookup_wait(keys: Sequence[BlockKey], lease_s: float | None, wait_s: float) -> bytes:
    return _LOOKUP_WAIT.pack(float(lease_s or 0.0), float(wait_s)) + encode_keys(keys)


def decode_lookup_wait(body: Any, limits: Limits) -> tuple[float | None, float, list[BlockKey]]:
    """``(lease_s, wait_s, keys)`` of a LOOKUP_WAIT body."""
    mv = memoryview(body).cast("B")
    if mv.nbytes < _LOOKUP_WAIT.size:
        raise ProtocolError("LOOKUP_WAIT body too short")
    lease_s, wait_s = _LOOKUP_WAIT.unpack_from(mv, 0)
    if not (lease_s == lease_s) or lease_s < 0 or lease_s > 86400:
        raise ProtocolError(f"lookup lease of {lease_s} s is out of range [0, 86400]")
    if not (wait_s == wait_s) or wait_s < 0 or wait_s > MAX_WAIT_S:
        raise ProtocolError(f"lookup wait of {wait_s} s is out of range [0, {MAX_WAIT_S:g}]")
    return (lease_s or None), wait_s, decode_keys(mv, limits, offset=_LOOKUP_WAIT.size)


_HINT = struct.Struct("<dIB3x")   # retain_s (0: none), priority, discard


def encode_hint(keys: Sequence[BlockKey], hint: Hint) -> bytes:
    return (_HINT.pack(hint.retain_s or 0.0, hint.priority, hint.discard) + _U32.pack(len(keys))
            + b"".join(k.to_bytes() for k in keys))


def decode_hint(body: Any, limits: Limits) -> tuple[Hint, list[BlockKey]]:
    mv = memoryview(body).cast("B")
    if mv.nbytes < _HINT.size:
        raise ProtocolError("hint body too short")
    retain_s, priority, discard = _HINT.unpack_from(mv, 0)
    if discard > 1:
        raise ProtocolError(f"hint discard flag {discard} is not 0 or 1")
    try:
        hint = Hint(retain_s or None, priority, bool(discard))
    except InvalidArgumentError as exc:
        raise ProtocolError(f"bad hint: {exc}") from None
    return hint, decode_keys(mv, limits, offset=_HINT.size)


def encode_records(dtype: np.dtype, keys: Sequence[BlockKey], *columns: Sequence[int]) -> bytes:
    rec = np.zeros(len(keys), dtype=dtype)
    if keys:
        rec["key"] = np.frombuffer(b"".join(k.to_bytes() for k in keys), dtype=f"V{KEY_WIRE_BYTES}")
    for name, values in zip(dtype.names[1:], columns):
        rec[name] = values
    return _U32.pack(len(keys)) + rec.tobytes()


def decode_records(dtype: np.dtype, body: Any, limits: Limits) -> tuple[list[BlockKey], np.ndarray]:
    """Keys and the record array (``nbytes``, maybe ``offset``) of a GET/PUT/SHM body."""
    mv = memoryview(body).cast("B")
    n = _count(mv, dtype.itemsize, limits)
    rec = np.frombuffer(mv, dtype=dtype, count=n, offset=4)
    for column in ("nbytes", "offset"):
        if column not in dtype.names:
            continue
        # Sizes and offsets stay far below 2**64 / max_batch, so no sum or end of them
        # can wrap in the unsigned arithmetic that checks them.
        if n and int(rec[column].max()) > MAX_FIELD:
            raise ProtocolError(f"{column} {int(rec[column].max())} exceeds {MAX_FIELD}")
    keys = _keys_from(rec["key"])
    if len(set(keys)) != n:
        raise ProtocolError("a key appears twice in one batch")
    return keys, rec


def encode_sizes(sizes: Sequence[int]) -> bytes:
    return np.asarray(sizes, dtype="<i8").tobytes()


def encode_summed(sizes: Sequence[int], sums: Sequence[int]) -> bytes:
    """A GET reply body: per key its size (or MISS / SIZE_MISMATCH / NOT_SENT) and the
    XXH3-64 of the block sent (0 where none is)."""
    rec = np.zeros(len(sizes), dtype=SUMMED)
    rec["nbytes"], rec["checksum"] = sizes, sums
    return rec.tobytes()


def decode_summed(body: Any, n: int) -> np.ndarray:
    mv = memoryview(body).cast("B")
    if mv.nbytes != n * SUMMED.itemsize:
        raise ProtocolError(f"reply of {mv.nbytes} bytes does not hold {n} sizes with checksums")
    return np.frombuffer(mv, dtype=SUMMED, count=n)


def decode_sizes(body: Any, n: int) -> np.ndarray:
    mv = memoryview(body).cast("B")
    if mv.nbytes != 8 * n:
        raise ProtocolError(f"reply of {mv.nbytes} bytes does not hold {n} sizes")
    return np.frombuffer(mv, dtype="<i8", count=n)


def decode_flags(body: Any, n: int) -> list[bool]:
    mv = memoryview(body).cast("B")
    if mv.nbytes != n:
        raise ProtocolError(f"reply of {mv.nbytes} bytes does not hold {n} flags")
    return [bool(b) for b in mv]


def encode_placed(lease_id: int, placed: np.ndarray) -> bytes:
    return _U64.pack(lease_id) + placed.tobytes()


def decode_placed(body: Any, n: int) -> tuple[int, np.ndarray]:
    mv = memoryview(body).cast("B")
    if mv.nbytes != 8 + n * PLACED.itemsize:
        raise ProtocolError(f"reply of {mv.nbytes} bytes does not hold {n} placements")
    return _U64.unpack_from(mv, 0)[0], np.frombuffer(mv, dtype=PLACED, count=n, offset=8)


def encode_commit(reservation_id: int, commit: bool, sums: Sequence[int] = ()) -> bytes:
    """SHM_COMMIT: the reservation, commit or abort, and (to commit) the writer's
    checksum of every key of the SHM_RESERVE, in its order (0 where nothing was written)."""
    return _COMMIT.pack(reservation_id, 1 if commit else 0, len(sums)) + np.asarray(sums, dtype="<u8").tobytes()


def decode_commit(body: Any, limits: Limits | None = None) -> tuple[int, bool, np.ndarray]:
    mv = memoryview(body).cast("B")
    if mv.nbytes < _COMMIT.size:
        raise ProtocolError(f"SHM_COMMIT body must be at least {_COMMIT.size} bytes, got {mv.nbytes}")
    rid, action, n = _COMMIT.unpack_from(mv, 0)
    if action > 1:
        raise ProtocolError(f"SHM_COMMIT action must be 0 (abort) or 1 (commit), got {action}")
    if limits is not None and n > limits.max_batch:
        raise ProtocolError(f"SHM_COMMIT carries {n} checksums, over max_batch {limits.max_batch}")
    if mv.nbytes != _COMMIT.size + 8 * n:
        raise ProtocolError(f"SHM_COMMIT body of {mv.nbytes} bytes does not hold {n} checksums")
    return rid, bool(action), np.frombuffer(mv, dtype="<u8", count=n, offset=_COMMIT.size)


def encode_u64(value: int) -> bytes:
    return _U64.pack(value)


def decode_u64(body: Any) -> int:
    return _decode_one(body, _U64)


def encode_u32(value: int) -> bytes:
    return _U32.pack(value)


def decode_u32(body: Any) -> int:
    return _decode_one(body, _U32)


def _decode_one(body: Any, fmt: struct.Struct) -> int:
    mv = memoryview(body).cast("B")
    if mv.nbytes != fmt.size:
        raise ProtocolError(f"expected a {fmt.size}-byte body, got {mv.nbytes}")
    return fmt.unpack_from(mv, 0)[0]


def encode_nixl(mem_kind: int, device: int, keys: Sequence[BlockKey], sizes: Sequence[int],
                addrs: Sequence[int], sums: Sequence[int] | None = None) -> bytes:
    """NIXL_GET / NIXL_PUT body; ``sums``: for a PUT, the client's checksum per block."""
    columns = (sizes, addrs) if sums is None else (sizes, addrs, sums)
    return _NIXL_HEAD.pack(mem_kind, device) + encode_records(NIXL_REC, keys, *columns)


def decode_nixl(body: Any, limits: Limits) -> tuple[int, int, list[BlockKey], np.ndarray]:
    """``(mem_kind, device, keys, records)`` of a NIXL_GET/NIXL_PUT body."""
    mv = memoryview(body).cast("B")
    if mv.nbytes < _NIXL_HEAD.size:
        raise ProtocolError(f"NIXL body of {mv.nbytes} bytes is too short")
    mem_kind, device = _NIXL_HEAD.unpack_from(mv, 0)
    if mem_kind not in (0, 1):
        raise ProtocolError(f"unknown NIXL memory kind {mem_kind}")
    keys, rec = decode_records(NIXL_REC, mv[_NIXL_HEAD.size:], limits)
    if len(keys) and int(rec["nbytes"].min()) == 0:
        raise ProtocolError("a NIXL transfer of 0 bytes")
    return mem_kind, device, keys, rec


def decode_request(header: Header, body: Any, limits: Limits) -> Any:
    """The decoded arguments of one request (what the server dispatches on). Checks the
    payload length against the body so a PUT cannot announce more bytes than it ships."""
    op = Op(header.op)
    if op is Op.HELLO or op is Op.SHM_ATTACH:
        args: Any = decode_json(body)
    elif op is Op.PING or op is Op.STATS:
        args = None
    elif op is Op.LOOKUP:
        args = decode_lookup(body, limits)
    elif op is Op.LOOKUP_WAIT:
        args = decode_lookup_wait(body, limits)
    elif op in (Op.CONTAINS, Op.DELETE, Op.RELEASE):
        args = decode_keys(body, limits)
    elif op is Op.CLEAR:
        args = decode_namespaces(body, limits)
    elif op is Op.HINT:
        args = decode_hint(body, limits)
    elif op is Op.GET or op is Op.SHM_GET or op is Op.SHM_RESERVE:
        args = decode_records(SIZED, body, limits)
    elif op is Op.PUT:
        args = decode_records(PUT_REC, body, limits)
        # Exact: decode_records capped every size at MAX_FIELD (2**40) and a batch at
        # max_batch records, so this unsigned sum cannot wrap.
        total = int(args[1]["nbytes"].sum(dtype=np.uint64)) if len(args[0]) else 0
        if total != header.payload_len:
            raise ProtocolError(f"PUT announces {total} block bytes but carries {header.payload_len}")
    elif op is Op.SHM_PUT:
        args = decode_records(STAGED, body, limits)
    elif op is Op.SHM_COMMIT:
        args = decode_commit(body, limits)
    elif op is Op.NIXL_HELLO:
        args = bytes(body)
        if not args:
            raise ProtocolError("NIXL_HELLO carries no agent metadata")
    elif op is Op.NIXL_GET or op is Op.NIXL_PUT:
        args = decode_nixl(body, limits)
    else:  # SHM_DONE
        args = decode_u64(body)
    if op is not Op.PUT and header.payload_len:
        raise ProtocolError(f"{op.name} carries no payload, got {header.payload_len} bytes")
    return args


def parse_requests(data: Any, limits: Limits) -> tuple[list[tuple[Header, Any]], int]:
    """Every complete request frame at the start of ``data``, decoded, and the number of
    bytes they span (a trailing partial frame is left). The server reads frames from its
    socket piecewise with the same :func:`parse_header` and :func:`decode_request`; this
    whole-buffer form serves tools and the fuzz tests."""
    mv = memoryview(data).cast("B")
    out, pos = [], 0
    while mv.nbytes - pos >= HEADER_BYTES:
        header = parse_header(mv[pos:pos + HEADER_BYTES], limits)
        end = pos + HEADER_BYTES + header.body_len
        if mv.nbytes < end + (header.payload_len if header.op == Op.PUT else 0):
            break
        out.append((header, decode_request(header, mv[pos + HEADER_BYTES:end], limits)))
        pos = end + header.payload_len
    return out, pos


__all__ = ["HEADER", "HEADER_BYTES", "Header", "Limits", "MAGIC", "MISS", "NIXL_REC", "NOT_SENT", "NO_REPLY",
           "Op", "PLACED", "PRESENT", "PUT_REC", "SUMMED", "decode_summed", "encode_summed", "decode_commit", "encode_commit", "decode_nixl", "encode_nixl",
           "SIZED", "SIZE_MISMATCH", "STAGED", "Status", "VERSION", "WHERE_ARENA", "WHERE_SOCKET",
           "WHERE_STAGING", "decode_flags", "decode_hint", "decode_json", "decode_keys", "decode_lookup", "encode_hint",
           "decode_lookup_wait", "encode_lookup_wait",
           "decode_placed", "decode_records", "decode_request", "decode_sizes", "decode_u32",
           "decode_u64", "encode_json", "parse_requests", "encode_keys", "encode_lookup", "encode_placed",
           "encode_records", "encode_sizes", "encode_u32", "encode_u64", "pack_header", "parse_header"]
