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
it would pass ``max_bytes``, keeping ``max_files`` files in all; a line that alone would
pass it keeps the ids that fit (a prefix of the request) and says how many it had in
``"truncated_from"``, so no file ever passes ``max_bytes``. Thread-safe. A write that
fails (disk full) stops the recording with a warning; the Store carries on.

The files are the server's own: created mode 0600 (a trace says which prompts a server
saw), opened without following a symbolic link (``O_NOFOLLOW``), relative to their
directory once it is checked (owned by this user or root, and not writable by group or
others unless sticky, as ``/tmp`` is), and refused when the file is not a regular file of
this user. So a link or a file planted in the directory cannot point the recorder, a
root server included, at a file of someone else's.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from kvstore.config import TraceConfig
from kvstore.config.base import shown
from kvstore.errors import ConfigError, InvalidArgumentError
from kvstore.keys import BlockKey

log = logging.getLogger(__name__)

_RECENT_IDS = 1 << 16   # ids of recent lookups remembered to leave their saves out
MAX_BLOCK_BYTES = 1 << 40   # a trace's block_bytes (and replay's --block-bytes): no KV block is larger


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
            self._dir = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigError(f"trace.path: cannot open {str(self.path)!r} for appending: {exc.strerror}") from None
        try:
            _check_dir(self._dir, self.path.parent)
            self._file = self._open()
        except BaseException:
            os.close(self._dir)
            raise
        self._size = self._file.tell()

    def _open(self) -> Any:
        """The current file for appending (see the module docstring: 0600, no link
        followed, this user's regular file)."""
        name, shown = self.path.name, repr(str(self.path))
        try:
            fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=self._dir)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ConfigError(f"trace.path: {shown} is a symbolic link; the trace is never written through "
                                  "one (give the real path)") from None
            raise ConfigError(f"trace.path: cannot open {shown} for appending: {exc.strerror}") from None
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "is not a regular file"
        elif st.st_uid != os.geteuid():
            problem = f"belongs to another user (uid {st.st_uid}); remove it or give another path"
        if problem is not None:
            os.close(fd)
            raise ConfigError(f"trace.path: {shown} {problem}")
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o600)     # a file made before traces were private
        return os.fdopen(fd, "a", encoding="ascii")

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
            if self._dir is not None:
                os.close(self._dir)
                self._dir = None

    def _write(self, ids: list[int], block_bytes: int | None, op: str | None) -> None:
        """Caller holds the lock."""
        if self._file is None:
            return
        stamp = int(time.time() * 1000)
        line = self._line(stamp, ids, block_bytes, op)
        if len(line) > self.config.max_bytes:   # alone past a file's bound: the ids that fit
            room = self.config.max_bytes - len(self._line(stamp, [], block_bytes, op, len(ids)))
            kept = 0
            for i in ids:
                room -= len(str(i)) + 1
                if room < 0:
                    break
                kept += 1
            line = self._line(stamp, ids[:kept], block_bytes, op, len(ids))
            while len(line) > self.config.max_bytes:     # input_length's digits, not counted above
                kept -= 1
                line = self._line(stamp, ids[:kept], block_bytes, op, len(ids))
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

    def _line(self, stamp: int, ids: list[int], block_bytes: int | None, op: str | None,
              truncated_from: int | None = None) -> str:
        record: dict[str, Any] = {"timestamp": stamp, "input_length": len(ids) * self.config.block_tokens,
                                  "output_length": 0, "hash_ids": ids}
        if op:
            record["op"] = op
        if block_bytes:
            record["block_bytes"] = block_bytes
        if truncated_from is not None:
            record["truncated_from"] = truncated_from
        return json.dumps(record, separators=(",", ":")) + "\n"

    def _rotate(self) -> None:
        """Names relative to the checked directory: a rename or unlink never follows a link."""
        self._file.close()
        d, name = self._dir, self.path.name
        keep = self.config.max_files - 1
        if keep == 0:
            os.unlink(name, dir_fd=d)
        else:
            for n in range(keep, 0, -1):
                older = f"{name}.{n}"
                try:
                    if n == keep:
                        os.unlink(older, dir_fd=d)
                    else:
                        os.rename(older, f"{name}.{n + 1}", src_dir_fd=d, dst_dir_fd=d)
                except FileNotFoundError:
                    pass
            os.rename(name, f"{name}.1", src_dir_fd=d, dst_dir_fd=d)
        try:
            self._file = self._open()
        except ConfigError as exc:
            raise OSError(str(exc)) from None   # something planted since: recording stops, as on a full disk
        self._size = 0


def _check_dir(fd: int, path: Path) -> None:
    """The trace directory is this user's (or root's) and no one else can swap files in
    it: not writable by group or others, unless sticky (as ``/tmp``)."""
    st = os.fstat(fd)
    shown = repr(str(path))
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"trace.path: the directory {shown} belongs to another user (uid {st.st_uid}); give a "
                          "directory of this user's (or root's)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(f"trace.path: the directory {shown} is writable by other users (mode "
                          f"{stat.S_IMODE(st.st_mode):o}) and not sticky: one of them could replace the trace "
                          "file; give a directory only this user can write (chmod go-w), or a sticky one")


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
    except RecursionError:
        raise InvalidArgumentError(f"{where}: not JSON a trace holds (nested too deeply)") from None
    if not isinstance(record, dict):
        raise InvalidArgumentError(f"{where}: expected an object, got {type(record).__name__}")
    ids = record.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InvalidArgumentError(f"{where}: hash_ids must be a list of integers")
    op = record.get("op", "lookup")
    if op not in ("lookup", "save"):
        raise InvalidArgumentError(f"{where}: op must be 'lookup' or 'save', got {shown(op)}")
    block_bytes = record.get("block_bytes")
    if block_bytes is not None and (not isinstance(block_bytes, int) or isinstance(block_bytes, bool)
                                    or not 0 < block_bytes <= MAX_BLOCK_BYTES):
        raise InvalidArgumentError(f"{where}: block_bytes must be a positive integer of at most "
                                   f"{MAX_BLOCK_BYTES} (1 TiB), got {shown(block_bytes)}")
    timestamp = record.get("timestamp", 0)
    if not isinstance(timestamp, (int, float)) or isinstance(timestamp, bool):
        raise InvalidArgumentError(f"{where}: timestamp must be a number, got {shown(timestamp)}")
    return TraceRequest(ids, op == "save", block_bytes, timestamp)


__all__ = ["MAX_BLOCK_BYTES", "TraceRecorder", "TraceRequest", "hash_id", "read_trace", "trace_files"]
