"""Access traces: what the Store was asked for, recorded for what-if replays.

A trace is JSON lines in the public prefix-hash trace format (the Mooncake FAST'25
release): one object per request, ``timestamp`` (ms), ``input_length``,
``output_length`` (tokens) and ``hash_ids`` (one integer per prefix block; equal ids
mean equal blocks, and an id always follows the same parent id). Recorded traces hold
key digests only, never payloads, and add two optional fields readers of the public
format ignore:

- ``"op": "save"`` on a save of blocks no recent lookup asked for (a decode tail, a
  client pushing blocks). Lines without ``op`` are lookups: a request's prompt. A save
  of blocks a recent lookup named is not written: replaying that lookup saves them.
- ``"block_bytes"``: the payload size of the request's blocks, where known.

``hash_ids`` are the first 8 bytes of each 32-byte key digest, big-endian, shifted
right by one bit (63 bits: a non-negative signed 64-bit integer). Keys are chained
digests, so an id stands for the whole prefix up to its block; two distinct blocks
share an id with probability ~n²/2⁶⁴ (n distinct blocks), which only blurs a replay's
statistics and never touches stored data. ``timestamp`` is Unix time in ms, so files
from several runs replay in order. ``input_length`` is blocks × ``block_tokens`` (the
Store sees blocks, not tokens); ``output_length`` is 0 (unknown to the Store).

:class:`TraceRecorder` writes ``path`` and rotates it to ``path.1``, ``path.2``, … when
it would pass ``max_bytes``, keeping ``max_files`` files in all. Thread-safe. A write
that fails (disk full) stops the recording with a warning; the Store carries on.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from kvstore.config import TraceConfig
from kvstore.errors import ConfigError, InvalidArgumentError
from kvstore.keys import BlockKey

log = logging.getLogger(__name__)

_RECENT_IDS = 1 << 16   # ids of recent lookups remembered to leave their saves out


def hash_id(key: BlockKey) -> int:
    """The trace's integer id of a key: its digest's first 8 bytes, big-endian, >> 1."""
    return int.from_bytes(key.digest[:8], "big") >> 1


class TraceRecorder:
    """Appends one JSON line per lookup (and per unexplained save) to a rotating file."""

    def __init__(self, config: TraceConfig) -> None:
        self.config = config
        self.path = Path(config.path)
        self.records = 0
        self._recent: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()
        self._last_block_bytes: int | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="ascii")
        except OSError as exc:
            raise ConfigError(f"trace.path: cannot open {str(self.path)!r} for appending: {exc.strerror}") from None
        self._size = self._file.tell()

    def lookup(self, keys: Sequence[BlockKey], block_bytes: int | None = None) -> None:
        """A request asked for the prefix ``keys``. Thread-safe."""
        if not keys:
            return
        ids = [hash_id(k) for k in keys]
        with self._lock:
            recent = self._recent
            for i in ids:
                recent[i] = None
                recent.move_to_end(i)
            while len(recent) > _RECENT_IDS:
                recent.popitem(last=False)
            self._write(ids, block_bytes or self._last_block_bytes, None)

    def save(self, keys: Sequence[BlockKey], block_bytes: int | None) -> None:
        """Blocks were offered for storing. Written only when no recent lookup named
        them all. Thread-safe."""
        if not keys:
            return
        ids = [hash_id(k) for k in keys]
        with self._lock:
            if block_bytes:
                self._last_block_bytes = block_bytes
            if all(i in self._recent for i in ids):
                return
            self._write(ids, block_bytes, "save")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _write(self, ids: list[int], block_bytes: int | None, op: str | None) -> None:
        """Caller holds the lock."""
        if self._file is None:
            return
        record = {"timestamp": int(time.time() * 1000), "input_length": len(ids) * self.config.block_tokens,
                  "output_length": 0, "hash_ids": ids}
        if op:
            record["op"] = op
        if block_bytes:
            record["block_bytes"] = block_bytes
        line = json.dumps(record, separators=(",", ":")) + "\n"
        try:
            if self._size and self._size + len(line) > self.config.max_bytes:
                self._rotate()
            self._file.write(line)
            self._file.flush()
        except OSError as exc:
            log.warning("access trace %s: write failed (%s); recording stopped", self.path, exc)
            self._file.close()
            self._file = None
            return
        self._size += len(line)
        self.records += 1

    def _rotate(self) -> None:
        self._file.close()
        keep = self.config.max_files - 1
        if keep == 0:
            os.unlink(self.path)
        else:
            for n in range(keep, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{n}")
                if older.exists():
                    if n == keep:
                        older.unlink()
                    else:
                        older.rename(self.path.with_name(f"{self.path.name}.{n + 1}"))
            self.path.rename(self.path.with_name(f"{self.path.name}.1"))
        self._file = open(self.path, "a", encoding="ascii")
        self._size = 0


def trace_files(path: str | os.PathLike) -> list[Path]:
    """``path`` and its rotated files, oldest first (``path.3``, ``path.2``, … ``path``)."""
    path = Path(path)
    rotated = []
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        rotated.append(path.with_name(f"{path.name}.{n}"))
        n += 1
    return [*reversed(rotated), path]


class TraceRequest:
    """One trace line: ``hash_ids``, whether it is a lookup (a request) or a bare save,
    and its block size where recorded."""

    __slots__ = ("hash_ids", "is_save", "block_bytes", "timestamp")

    def __init__(self, hash_ids: list[int], is_save: bool, block_bytes: int | None, timestamp: float) -> None:
        self.hash_ids, self.is_save, self.block_bytes, self.timestamp = hash_ids, is_save, block_bytes, timestamp


def read_trace(paths: Iterable[str | os.PathLike], limit: int | None = None) -> Iterator[TraceRequest]:
    """The lines of trace files, in order; at most ``limit`` of them. A malformed line
    raises :class:`InvalidArgumentError` naming the file and line."""
    count = 0
    for path in paths:
        try:
            lines = open(path, encoding="utf-8")
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read trace {str(path)!r}: {exc.strerror}") from None
        with lines:
            for number, line in enumerate(lines, 1):
                if limit is not None and count >= limit:
                    return
                if not line.strip():
                    continue
                yield _parse(line, path, number)
                count += 1


def _parse(line: str, path: str | os.PathLike, number: int) -> TraceRequest:
    where = f"trace {str(path)!r} line {number}"
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise InvalidArgumentError(f"{where}: not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise InvalidArgumentError(f"{where}: expected an object, got {type(record).__name__}")
    ids = record.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InvalidArgumentError(f"{where}: hash_ids must be a list of integers")
    op = record.get("op", "lookup")
    if op not in ("lookup", "save"):
        raise InvalidArgumentError(f"{where}: op must be 'lookup' or 'save', got {op!r}")
    block_bytes = record.get("block_bytes")
    if block_bytes is not None and (not isinstance(block_bytes, int) or block_bytes <= 0):
        raise InvalidArgumentError(f"{where}: block_bytes must be a positive integer, got {block_bytes!r}")
    timestamp = record.get("timestamp", 0)
    if not isinstance(timestamp, (int, float)) or isinstance(timestamp, bool):
        raise InvalidArgumentError(f"{where}: timestamp must be a number, got {timestamp!r}")
    return TraceRequest(ids, op == "save", block_bytes, timestamp)


__all__ = ["TraceRecorder", "TraceRequest", "hash_id", "read_trace", "trace_files"]
