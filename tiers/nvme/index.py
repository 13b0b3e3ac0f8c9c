"""The NVMe tier's LMDB index: the source of truth for what one directory holds.

Four named databases in ``<dir>/index``:

- ``blocks``: key digest (32 B) -> immutable record (file number, offset, payload
  length, payload checksum, the 96-byte ``BlockKey.to_bytes()`` with parent and
  namespace), followed by an XXH3-64 of the record so a damaged value is detected.
- ``access``: key digest -> last access time (float64 seconds since the epoch). Kept
  apart so a hit rewrites 8 bytes, never the record; the tier batches these updates.
- ``meta``: format version and the size of every data file (``file:<n>``), so a data
  file truncated behind our back is noticed and restored to its size.
- ``hints``: key digest -> the Store's retention hint for the block (a few opaque
  bytes, see ``kvstore.store.hints``). Advice, not data: written in batches with the access
  times, deleted with the block. An index without it (an older one) gains it on open.

LMDB serialises writers itself; readers never block. Thread-safe.
"""

from __future__ import annotations

import os
import struct
from typing import Iterable, Iterator, NamedTuple

import lmdb
import numpy as np
import xxhash

from kvstore.errors import TierIOError
from kvstore.keys import KEY_WIRE_BYTES

FORMAT_VERSION = 1
_REC = struct.Struct(f"<BxxxIQQQ{KEY_WIRE_BYTES}s")
_SUM = struct.Struct("<Q")
_TIME = struct.Struct("<d")
_U64 = struct.Struct("<Q")
RECORD_BYTES = _REC.size + _SUM.size
# The same record as a numpy structured type, for decoding a whole index in one step.
_REC_DTYPE = np.dtype([("version", "u1"), ("pad", "V3"), ("file_no", "<u4"), ("offset", "<u8"),
                       ("length", "<u8"), ("checksum", "<u8"), ("key", f"V{KEY_WIRE_BYTES}"),
                       ("sum", "<u8")])
assert _REC_DTYPE.itemsize == RECORD_BYTES
KEY_OFFSET = _REC_DTYPE.fields["key"][1]   # where BlockKey.to_bytes() starts in a record


class Snapshot(NamedTuple):
    """Every indexed block at once, from one read transaction (see :meth:`BlockIndex.load`).

    ``digests`` and ``values`` are the raw LMDB keys and values, sorted by digest; the
    arrays are parallel to them. ``ok[i]`` is False for a damaged record (wrong size,
    bad checksum, unknown version, names another key); its other fields are then junk.
    ``stray`` lists access entries without a block record.
    """

    digests: list[bytes]
    values: list[bytes]
    ok: np.ndarray          # bool
    file_no: np.ndarray     # uint32
    offset: np.ndarray      # uint64
    length: np.ndarray      # uint64
    checksum: np.ndarray    # uint64
    has_parent: np.ndarray  # bool: key bytes 32..64 are not all zero
    has_namespace: np.ndarray  # bool: key bytes 64..96 are not all zero
    last: np.ndarray        # float64, 0.0 where no access time was recorded
    stray: list[bytes]


class Record(NamedTuple):
    """Where one block lives. ``key_bytes`` is ``BlockKey.to_bytes()``. A tuple, so a
    million of them decode quickly at start-up."""

    file_no: int
    offset: int
    length: int
    checksum: int
    key_bytes: bytes

    def encode(self) -> bytes:
        body = _REC.pack(FORMAT_VERSION, self.file_no, self.offset, self.length, self.checksum, self.key_bytes)
        return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))

    @classmethod
    def decode(cls, digest: bytes, value: bytes) -> "Record | None":
        """The record, or ``None`` when the value is damaged or names another key."""
        if len(value) != RECORD_BYTES:
            return None
        body = value[:_REC.size]
        if _SUM.unpack_from(value, _REC.size)[0] != xxhash.xxh3_64_intdigest(body):
            return None
        version, file_no, offset, length, csum, key_bytes = _REC.unpack(body)
        if version != FORMAT_VERSION or key_bytes[:32] != digest:
            return None
        return tuple.__new__(cls, (file_no, offset, length, csum, key_bytes))


class BlockIndex:
    """One directory's index. ``sync``: fsync each commit (durable across power loss);
    without it a commit survives a process crash but not a machine crash."""

    def __init__(self, directory: str, *, map_size: int = 1 << 36, sync: bool = True,
                 readonly: bool = False) -> None:
        path = os.path.join(directory, "index")
        try:
            # Key digests are the cache's table of contents: readable by this user only.
            self.env = lmdb.open(path, map_size=map_size, max_dbs=4, subdir=True, sync=sync,
                                 metasync=False, readahead=False, lock=True, readonly=readonly,
                                 create=not readonly, mode=0o600)
            self._blocks = self.env.open_db(b"blocks", create=not readonly)
            self._access = self.env.open_db(b"access", create=not readonly)
            self._meta = self.env.open_db(b"meta", create=not readonly)
            self._hints = self._open_optional(b"hints", readonly)
        except lmdb.Error as exc:
            raise TierIOError(f"cannot open index {path}: {exc}") from exc
        self.path = path
        if not readonly:
            self._check_version()

    def _open_optional(self, name: bytes, readonly: bool):
        """A database that older indexes lack: created, or ``None`` when read-only."""
        try:
            return self.env.open_db(name, create=not readonly)
        except lmdb.NotFoundError:
            return None

    def _check_version(self) -> None:
        with self.env.begin(write=True) as txn:
            raw = txn.get(b"version", db=self._meta)
            if raw is None:
                txn.put(b"version", _U64.pack(FORMAT_VERSION), db=self._meta)
            elif _U64.unpack(raw)[0] != FORMAT_VERSION:
                raise TierIOError(f"index {self.path} has format {_U64.unpack(raw)[0]}, "
                                  f"this build reads {FORMAT_VERSION}")

    # -- reads ----------------------------------------------------------------------------

    def scan(self) -> Iterator[tuple[bytes, Record | None, float]]:
        """Every indexed block: ``(digest, record or None if damaged, last_access)``.
        One read transaction, so a consistent snapshot."""
        with self.env.begin() as txn:
            # both databases are sorted by digest: walk them side by side (a merge join)
            access = iter(txn.cursor(db=self._access))
            adigest, araw = next(access, (None, None))
            for digest, value in txn.cursor(db=self._blocks):
                while adigest is not None and adigest < digest:
                    adigest, araw = next(access, (None, None))
                last = _TIME.unpack(araw)[0] if adigest == digest and len(araw) == _TIME.size else 0.0
                yield digest, Record.decode(digest, value), last

    def load(self) -> Snapshot:
        """The whole index decoded in bulk: one cursor pass per database, records checked
        and unpacked as arrays rather than one Python object per field. What restart
        uses; :meth:`scan` gives the same facts one row at a time."""
        with self.env.begin() as txn:
            blocks = txn.cursor(db=self._blocks)
            digests = list(blocks.iternext(keys=True, values=False))
            values = list(blocks.iternext(keys=False, values=True))
            access = txn.cursor(db=self._access)
            adigests = list(access.iternext(keys=True, values=False))
            araw = list(access.iternext(keys=False, values=True))
        n = len(digests)
        sized = np.fromiter(map(len, values), np.int64, n) == RECORD_BYTES
        blank = bytes(RECORD_BYTES)
        blob = b"".join(values) if sized.all() else b"".join(v if len(v) == RECORD_BYTES else blank
                                                               for v in values)
        rec = np.frombuffer(blob, _REC_DTYPE, n)
        body = _REC.size
        sums = np.fromiter((xxhash.xxh3_64_intdigest(memoryview(blob)[i:i + body])
                            for i in range(0, n * RECORD_BYTES, RECORD_BYTES)), np.uint64, n)
        raw = np.frombuffer(blob, np.uint8).reshape(n, RECORD_BYTES)
        key_at = KEY_OFFSET
        keyed = np.fromiter(map(len, digests), np.int64, n) == 32   # another length: damage
        names = b"".join(digests) if keyed.all() else b"".join(d if len(d) == 32 else bytes(32) for d in digests)
        named = np.frombuffer(names, np.uint8).reshape(n, 32)
        ok = (sized & keyed & (rec["sum"] == sums) & (rec["version"] == FORMAT_VERSION)
              & (raw[:, key_at:key_at + 32] == named).all(axis=1))
        key = raw[:, key_at:key_at + KEY_WIRE_BYTES]
        if adigests == digests and all(len(v) == _TIME.size for v in araw):
            last = np.frombuffer(b"".join(araw), "<f8", n).copy()
            stray: list[bytes] = []
        else:   # rare: a crash between writes, or damage; match the two up by digest
            times = {d: _TIME.unpack(v)[0] for d, v in zip(adigests, araw) if len(v) == _TIME.size}
            last = np.fromiter((times.get(d, 0.0) for d in digests), np.float64, n)
            indexed = set(digests)
            stray = [d for d in adigests if d not in indexed]
        return Snapshot(digests, values, ok, rec["file_no"].astype(np.int64), rec["offset"].astype(np.int64),
                        rec["length"].astype(np.int64), rec["checksum"].copy(),
                        key[:, 32:64].any(axis=1), key[:, 64:].any(axis=1), last, stray)

    def stray_access(self) -> list[bytes]:
        """Access entries with no block record (left by a crash between two writes)."""
        with self.env.begin() as txn:
            blocks = txn.cursor(db=self._blocks)
            return [d for d, _ in txn.cursor(db=self._access) if not blocks.set_key(d)]

    def hints(self) -> dict[bytes, bytes]:
        """Every recorded retention hint, by key digest (one read transaction)."""
        if self._hints is None:
            return {}
        with self.env.begin() as txn:
            return dict(txn.cursor(db=self._hints))

    def file_sizes(self) -> dict[int, int]:
        with self.env.begin() as txn:
            out = {}
            for k, v in txn.cursor(db=self._meta):
                if k.startswith(b"file:"):
                    out[int(k[5:])] = _U64.unpack(v)[0]
            return out

    def __len__(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self._blocks)["entries"]

    # -- writes ---------------------------------------------------------------------------

    def put(self, items: Iterable[tuple[bytes, Record, float]]) -> None:
        """Commit records with their access times in one transaction."""
        self._write(puts=items)

    def delete(self, digests: Iterable[bytes]) -> None:
        self._write(deletes=digests)

    def touch(self, times: dict[bytes, float], hints: dict[bytes, bytes] | None = None) -> None:
        """Record last-access times and retention hints (only for digests still
        indexed), in one transaction."""
        self._write(touches=times, hints=hints)

    def set_file_size(self, file_no: int, nbytes: int) -> None:
        try:
            with self.env.begin(write=True) as txn:
                txn.put(b"file:%d" % file_no, _U64.pack(nbytes), db=self._meta)
        except lmdb.Error as exc:
            raise TierIOError(f"index {self.path}: {exc}") from exc

    def _write(self, *, puts=(), deletes=(), touches=None, hints=None) -> None:
        try:
            with self.env.begin(write=True) as txn:
                for digest, rec, last in puts:
                    txn.put(digest, rec.encode(), db=self._blocks)
                    txn.put(digest, _TIME.pack(last), db=self._access)
                for digest in deletes:
                    txn.delete(digest, db=self._blocks)
                    txn.delete(digest, db=self._access)
                    if self._hints is not None:
                        txn.delete(digest, db=self._hints)
                if touches:
                    blocks = txn.cursor(db=self._blocks)
                    for digest, last in touches.items():
                        if blocks.set_key(digest):
                            txn.put(digest, _TIME.pack(last), db=self._access)
                if hints and self._hints is not None:
                    blocks = txn.cursor(db=self._blocks)
                    for digest, raw in hints.items():
                        if blocks.set_key(digest):
                            txn.put(digest, raw, db=self._hints)
        except lmdb.Error as exc:
            raise TierIOError(f"index {self.path}: {exc}") from exc

    def sync(self) -> None:
        try:
            self.env.sync(True)
        except lmdb.Error as exc:
            raise TierIOError(f"index {self.path}: {exc}") from exc

    def close(self) -> None:
        self.env.close()
