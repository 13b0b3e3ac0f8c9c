"""Local NVMe tier: preallocated data files, an LMDB index, direct I/O, verified reads.

Each configured directory (one per drive) is a self-contained shard: a few large data
files carved into page-aligned extents, an LMDB index that is the source of truth after
a restart, and an exclusive lock. Writes stripe over shards by free space.

Write protocol: reserve an extent in memory, write header page + payload (``O_DIRECT``,
in parallel on the tier's I/O pool), then commit the whole batch's records in one LMDB
transaction. A crash before the commit leaves only unindexed bytes, whose extents are
free again on restart (orphans are reclaimed by construction); a crash after it leaves
complete, checksummed blocks. Reads verify header and checksum in the caller's buffer;
a mismatch is a miss, the copy is removed and ``corrupt_blocks`` rises.

Last-access times and the Store's retention hints live in memory and are flushed to the
index in one transaction every ``access_flush_s`` (and on close), so neither a hit nor
a hint waits for an index write.

Thread-safe. Buffer ownership: ``write`` reads caller buffers only during the call;
``read_into`` writes into caller buffers only during the call.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Iterator, Sequence

import numpy as np

from kvstore.block import FLAG_SEGMENTED
from kvstore.config.tiers import NvmeTierConfig
from kvstore.buffers import host_view, is_device, nbytes_of
from kvstore.errors import CorruptBlockError, InvalidArgumentError, StoreClosedError, TierError
from kvstore.keys import BlockKey
from kvstore.tiers.base import RecoveredBlock, Tier, TierCapabilities, check_batch, check_sizes
from kvstore.tiers.nvme.batch import WriteItem, in_runs
from kvstore.tiers.nvme.files import Shard, data_file_name, place
from kvstore.tiers.nvme.gpu import DeviceIO
from kvstore.tiers.nvme.index import Record
from kvstore.tiers.nvme.io import PAGE, READ_RUN_BYTES, check_run, land_run, read_block, write_block, write_run
from kvstore.tiers.nvme.open import Entry, open_shard, paused_gc
from kvstore.tiers.nvme.readahead import ReadAhead

log = logging.getLogger(__name__)
_D = NvmeTierConfig.defaults()   # keyword defaults: the config model's (one definition)


class NvmeTier(Tier):
    """Blocks in data files under ``paths`` (one directory per drive), ``capacity_bytes``
    of payload in all, split evenly over the directories.

    ``direct_io``: use ``O_DIRECT`` where the file system allows (else buffered, logged).
    ``file_bytes``: size of each data file, created on demand. ``io_threads``: requests
    in flight per batch. ``index_sync``: fsync each index commit (durable across power
    loss). A batch's records are committed behind its write, on the tier's index thread,
    so a crash can lose the last batch written (never serve wrong bytes; see
    docs/nvme.md, *Recovery*). ``access_flush_s``: how often
    last-access times reach the index. ``readahead_bytes``: the most a sequential stream
    of batches reads ahead (see :mod:`tiers.nvme.readahead`; 0 turns it off).
    ``device_verify``: write blocks with the segmented checksum (``FLAG_SEGMENTED``), so
    reads into CUDA memory through kvikio are verified on the device (see
    :mod:`tiers.nvme.gpu`); blocks of either kind are read either way.
    """

    def __init__(self, paths: str | Sequence[str], capacity_bytes: int, *, name: str = "nvme",
                 direct_io: bool = _D.direct_io, file_bytes: int = _D.file_bytes, io_threads: int = _D.io_threads,
                 index_sync: bool = _D.index_sync, access_flush_s: float = _D.access_flush_s,
                 readahead_bytes: int = _D.readahead_bytes, device_verify: bool = _D.device_verify) -> None:
        paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        if not paths:
            raise InvalidArgumentError("NVMe tier needs at least one directory")
        if capacity_bytes <= 0:
            raise InvalidArgumentError(f"NVMe tier capacity must be positive, got {capacity_bytes}")
        if len({os.path.realpath(p) for p in paths}) != len(paths):
            raise InvalidArgumentError(f"NVMe tier directories must be distinct: {paths}")
        self.name = name
        self._capacity = int(capacity_bytes)
        self._lock = threading.Lock()       # entries, accounting, allocators
        self._commit = threading.Lock()     # orders index commits against the entries map
        self._entries: dict[BlockKey, Entry] = {}
        self._pending: set[BlockKey] = set()
        self._touched: dict[BlockKey, Entry] = {}
        self._hinted: dict[BlockKey, bytes] = {}   # retention hints not yet in the index
        self._used = 0
        self._clock_last = 0.0
        self._flush_s = access_flush_s
        self._last_flush = time.monotonic()
        self.counters = dict.fromkeys(("corrupt_blocks", "io_errors", "enospc", "recovered_blocks",
                                       "dropped_at_open", "readahead_hits"), 0)
        self._shards: list[Shard] = []
        per, extra = divmod(self._capacity, len(paths))
        try:
            for i, path in enumerate(paths):
                self._shards.append(Shard(i, os.fspath(path), per + (extra if i == 0 else 0),
                                           direct=direct_io, file_bytes=file_bytes, sync=index_sync))
            for shard in self._shards:
                self._open_shard(shard)
        except BaseException:
            for shard in self._shards:
                shard.close()
            raise
        direct = [s.direct for s in self._shards]
        self.io_mode = "direct" if all(direct) else "buffered" if not any(direct) else "mixed"
        if direct_io and not all(direct):
            log.warning("NVMe tier %s: O_DIRECT refused in %s; using buffered I/O there", name,
                        ", ".join(s.path for s in self._shards if not s.direct))
        self._device = DeviceIO()
        self._flags = FLAG_SEGMENTED if device_verify else 0
        self._io_threads = io_threads
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix=f"kvstore-{name}")
        # a write batch's index records are committed here while the caller goes on (the
        # next batch's data moves during the commit's fsync); one commit in flight at a time
        self._committer = ThreadPoolExecutor(1, thread_name_prefix=f"kvstore-{name}-index")
        self._committing: Future | None = None
        # buffered I/O has the kernel's own read-ahead
        self._readahead = (ReadAhead(self._pool, readahead_bytes)
                           if readahead_bytes >= PAGE and self.io_mode == "direct" else None)
        self._closed = False
        # a writer's XXH3-64 is kept as the block's checksum only where it is the kind
        # this tier writes (not with device_verify's segmented one)
        self.capabilities = TierCapabilities(device="disk", persistent=True, alignment=PAGE,
                                             max_concurrency=io_threads, write_checksums=not device_verify)

    # -- start-up -------------------------------------------------------------------------

    def _open_shard(self, shard: Shard) -> None:
        """Rebuild accounting and allocators from the index (see :mod:`tiers.nvme.open`)."""
        kept, used = open_shard(shard, self.name, self.counters)
        self._entries.update(kept)
        if kept:
            self._clock_last = max(self._clock_last, kept[-1][1].last)   # kept is oldest first
        shard.used = used
        self._used += used
        self.counters["recovered_blocks"] += len(kept)

    # -- the Tier contract ----------------------------------------------------------------

    def nbytes(self, key: BlockKey) -> int | None:
        e = self._entries.get(key)
        return e.length if e else None

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        entries = self._entries
        return [k in entries for k in keys]

    def keys(self) -> Iterator[BlockKey]:
        with self._lock:
            return iter(list(self._entries))

    def recover(self) -> list[RecoveredBlock]:
        with self._lock:
            items = list(self._entries.items())
            lasts = np.fromiter((e.last for _, e in items), np.float64, len(items))
        order = np.argsort(lasts, kind="stable").tolist()
        hints: dict[bytes, bytes] = {}
        for shard in self._shards:
            hints.update(shard.index.hints())
        with self._lock:
            hints.update((k.digest, raw) for k, raw in self._hinted.items())
        with paused_gc():
            return [RecoveredBlock(k, e.length, e.last, hints.get(k.digest))
                    for k, e in map(items.__getitem__, order)]

    def set_hints(self, hints) -> None:
        """Kept in memory, written to the index with the next access-time flush."""
        with self._lock:
            self._hinted.update(hints)
        if time.monotonic() - self._last_flush >= self._flush_s:
            self.flush_access()

    def write(self, keys: Sequence[BlockKey], srcs: Sequence[Any],
              checksums: Sequence[int | None] | None = None) -> list[bool]:
        """See :meth:`Tier.write`; ``checksums`` (the writer's XXH3-64 per source, taken
        only without ``device_verify``) go into the block headers as they are, so a source
        changed since its writer hashed it is a corrupt block on its first read."""
        check_batch(keys, srcs)
        if checksums is not None:
            check_batch(keys, checksums, "checksums")
        given = {k: c for k, c in zip(keys, checksums) if c is not None} if checksums and not self._flags else {}
        out = [False] * len(keys)
        plan: list[WriteItem] = []
        with self._lock:
            self._check_open()
            for j, (key, src) in enumerate(zip(keys, srcs)):
                if key in self._entries or key in self._pending:
                    out[j] = True
                    continue
                n = nbytes_of(src)
                if self._used + n > self._capacity:
                    continue
                where = place(self._shards, n, self.name, self.counters)   # striped by free space
                if where is not None:
                    self._used += n
                    self._pending.add(key)
                    plan.append(WriteItem(j, key, src, *where, n))
        if not plan:
            return out
        results = in_runs(self._pool, self._io_threads, partial(self._write_run, given), plan, [p.src for p in plan],
                          [(p.shard.no, p.file_no, p.offset) for p in plan], [p.nbytes for p in plan],
                          writable=False)
        done: dict[Shard, list[tuple[WriteItem, int]]] = {}
        failed: list[WriteItem] = []
        first_error = None
        for p, (ok, value) in zip(plan, results):
            if ok:
                done.setdefault(p.shard, []).append((p, value))
            else:
                failed.append(p)
                first_error = first_error or self._count_failure(value, "write")
        with self._commit:
            self._settle()   # the previous batch's records first: commits stay in order
            records: dict[Shard, list[tuple[BlockKey, Entry]]] = {}
            with self._lock:
                for shard, items in done.items():
                    stamps = self._stamps_locked(len(items))
                    for (p, csum), last in zip(items, stamps):
                        e = self._entries[p.key] = Entry(shard, p.file_no, p.offset, p.nbytes, csum, last)
                        records.setdefault(shard, []).append((p.key, e))
                        self._pending.discard(p.key)
                        out[p.j] = True
                for p in failed:
                    p.shard.data.free(p.file_no, p.offset, p.nbytes)
                    p.shard.used -= p.nbytes
                    self._used -= p.nbytes
                    self._pending.discard(p.key)
            if records:
                self._committing = self._committer.submit(self._commit_records, records)
        if first_error is not None:
            raise first_error
        return out

    def read_into(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> list[bool]:
        out = [False] * len(keys)
        jobs = []
        check_batch(keys, dsts)
        with self._lock:
            self._check_open()
            found = [(j, key, self._entries.get(key), dst) for j, (key, dst) in enumerate(zip(keys, dsts))]
            found = [f for f in found if f[2] is not None]
            check_sizes(self.name, [f[3] for f in found], [f[2] for f in found])
            for j, key, e, dst in found:
                e.readers += 1
                jobs.append((j, key, e, dst))
        try:
            results = self._read_jobs(jobs)
        finally:
            with self._lock:
                for _, _, e, _ in jobs:
                    self._unread(e)
        bad = []
        first_error = None
        stamps = iter(self._stamps(len(jobs)))
        for (j, key, e, _), (ok, value) in zip(jobs, results):
            if ok:
                out[j] = True
                e.last = next(stamps)
                self._touched[key] = e
            else:
                error = self._count_failure(value, "read")
                if error is None:
                    bad.append((key, e))   # the medium failed us: this copy goes
                else:
                    first_error = first_error or error   # the caller's buffer: the copy stays
        if bad:
            self._remove(bad)
        if first_error is not None:
            raise first_error
        if time.monotonic() - self._last_flush >= self._flush_s:
            self.flush_access()
        return out

    def delete(self, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            self._check_open()
            found = [(k, self._entries[k]) for k in dict.fromkeys(keys) if k in self._entries]
        return self._remove(found)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            files = sum(len(s.data.files) for s in self._shards)
            disk = sum(s.data.file_bytes for s in self._shards)
            allocated = sum(s.data.allocated_bytes for s in self._shards)
        return {**self.counters, "io_mode": self.io_mode, "gpu_io": self._device.mode,
                "device_verify": bool(self._flags), "verified_on_device": self._device.verified_on_device,
                "directories": len(self._shards), "data_files": files, "file_bytes": disk,
                "allocated_bytes": allocated, "index_entries": len(self._entries)}

    def flush_access(self) -> None:
        """Write pending last-access times to the index (one transaction per directory)."""
        with self._commit:
            self._settle()
            with self._lock:
                touched, self._touched = self._touched, {}
                hinted, self._hinted = self._hinted, {}
                held = [(self._entries.get(k), k, raw) for k, raw in hinted.items()]
            self._last_flush = time.monotonic()
            by_shard: dict[Shard, tuple[dict[bytes, float], dict[bytes, bytes]]] = {}
            for key, e in touched.items():
                if not e.dead:
                    by_shard.setdefault(e.shard, ({}, {}))[0][key.digest] = e.last
            for e, key, raw in held:
                if e is not None and not e.dead:
                    by_shard.setdefault(e.shard, ({}, {}))[1][key.digest] = raw
            for shard, (times, hints) in by_shard.items():
                try:
                    shard.index.touch(times, hints)
                except TierError as exc:
                    log.warning("NVMe tier %s: could not record access times: %s", self.name, exc)

    def close(self) -> None:
        with self._lock:
            if getattr(self, "_closed", True):
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        self.flush_access()   # also waits for the last index commit
        self._committer.shutdown(wait=True)
        self._device.close()
        for shard in self._shards:
            try:
                shard.index.sync()
            except TierError as exc:
                log.warning("NVMe tier %s: %s", self.name, exc)
            shard.close()

    # -- internals --------------------------------------------------------------------------

    def _write_run(self, given: dict, run: list[WriteItem], views: list) -> list[tuple[bool, Any]]:
        """Write one run of ``plan`` items; ``given``: the writer's checksums by key."""
        first = run[0]
        if len(run) == 1:
            return [(True, self._write_one(first.key, first.src, first.shard, first.file_no, first.offset,
                                           given.get(first.key)))]
        sums = write_run(first.shard.data.fd(first.file_no), first.offset, [p.key.digest for p in run], views,
                         self._flags, [given.get(p.key) for p in run])
        return [(True, csum) for csum in sums]

    def _read_jobs(self, jobs: list[tuple]) -> list[tuple[bool, Any]]:
        """Read ``jobs`` (``(j, key, entry, dst)``); ``(ok, error)`` per job, in order.
        Blocks found in the read-ahead window are copied from it, the rest read directly."""
        ra = self._readahead
        if ra is None or not jobs or not ra.lock.acquire(blocking=False):
            return self._read_direct(jobs)
        try:
            out, hits = ra.read(jobs, self._read_direct, self._file_of)
        finally:
            ra.lock.release()
        if hits:
            with self._lock:
                self.counters["readahead_hits"] += hits
        return out

    def _read_direct(self, jobs: list[tuple]) -> list[tuple[bool, Any]]:
        return in_runs(self._pool, self._io_threads, self._land_run, jobs, [job[3] for job in jobs],
                       [(e.shard.no, e.file_no, e.offset) for _, _, e, _ in jobs],
                       [e.length for _, _, e, _ in jobs], writable=True, run_bytes=READ_RUN_BYTES,
                       check=self._check_run)

    def _file_of(self, file: tuple[int, int]) -> tuple[int, int]:
        """``(fd, size)`` of data file ``(directory number, file number)``."""
        data = self._shards[file[0]].data
        return data.fd(file[1]), data.files[file[1]].size

    def _land_run(self, run: list[tuple], views: list) -> Any:
        """A pool thread's half of a read: the transfer. A run of host views is verified
        by :meth:`_check_run` on the calling thread; any other buffer (device memory, an
        unaligned or odd-sized one) moves on its own and is verified here, so this
        returns its per-block result."""
        if views[0] is None:
            _, key, e, dst = run[0]
            self._read_one(key, e, dst)
            return [(True, None)]
        e = run[0][2]
        return land_run(e.shard.data.fd(e.file_no), e.offset, views)

    def _check_run(self, run: list[tuple], views: list, landed: Any) -> list[tuple[bool, Any]]:
        if views[0] is None:
            return landed
        errors = check_run(run[0][2].offset, [(key.digest, e.length, e.checksum) for _, key, e, _ in run],
                           views, landed)
        return [(True, None) if err is None else (False, err) for err in errors]

    def _write_one(self, key: BlockKey, src: Any, shard: Shard, file_no: int, offset: int,
                   csum: int | None = None) -> int:
        payload = self._device.stage(src) if is_device(src) else host_view(src)
        return write_block(shard.data.fd(file_no), offset, key.digest, payload, self._flags, csum)

    def _read_one(self, key: BlockKey, e: Entry, dst: Any) -> None:
        fd = e.shard.data.fd(e.file_no)
        if is_device(dst):
            path = os.path.join(e.shard.path, data_file_name(e.file_no))
            self._device.read(fd, path, e.offset, key.digest, e.length, e.checksum, dst)
        else:
            read_block(fd, e.offset, key.digest, e.length, e.checksum, host_view(dst, writable=True))

    def _count_failure(self, exc: BaseException, what: str) -> BaseException | None:
        """Count a failed block I/O; returns ``exc`` when it must reach the caller (a bug
        or bad argument, not a media failure)."""
        with self._lock:
            if isinstance(exc, CorruptBlockError):
                self.counters["corrupt_blocks"] += 1
                log.warning("NVMe tier %s: corrupt block dropped on %s: %s", self.name, what, exc)
                return None
            if isinstance(exc, (TierError, OSError)):
                self.counters["enospc" if getattr(exc, "errno", None) == errno.ENOSPC else "io_errors"] += 1
                log.warning("NVMe tier %s: %s failed: %s", self.name, what, exc)
                return None
        return exc

    def _remove(self, found: list[tuple[BlockKey, Entry]]) -> int:
        """Drop entries (still the same objects) from memory, then the index; extents are
        freed once the index no longer names them and no reader holds them."""
        with self._commit:
            self._settle()   # a record still being committed must not outlive its delete
            with self._lock:
                gone = self._forget(found)
            by_shard: dict[Shard, list[bytes]] = {}
            for key, e in gone:
                by_shard.setdefault(e.shard, []).append(key.digest)
            for shard, digests in by_shard.items():
                try:
                    shard.index.delete(digests)
                except TierError as exc:
                    self._count_failure(exc, "index delete")
            with self._lock:
                self._release(gone)   # only now: an extent must outlive its index record
        return len(gone)

    def _commit_records(self, records: dict[Shard, list[tuple[BlockKey, Entry]]]) -> list[tuple[BlockKey, Entry]]:
        """The committer thread's half of a write: one index transaction per directory.
        Returns the blocks whose commit failed (:meth:`_settle` drops them)."""
        lost = []
        for shard, items in records.items():
            try:
                shard.index.put((key.digest, Record(e.file_no, e.offset, e.length, e.checksum, key.to_bytes()),
                                 e.last) for key, e in items)
            except TierError as exc:
                self._count_failure(exc, "index commit")
                lost.extend(items)
        return lost

    def _settle(self) -> None:
        """Wait for the index commit in flight, if any; blocks it could not commit are
        dropped, as if evicted. Caller holds ``_commit``."""
        task, self._committing = self._committing, None
        lost = task.result() if task is not None else []
        if lost:
            with self._lock:
                self._release(self._forget(lost))

    def _forget(self, found: list[tuple[BlockKey, Entry]]) -> list[tuple[BlockKey, Entry]]:
        """Take the entries that are still these objects out of memory and out of the
        accounting; returns them. Caller holds the lock."""
        gone = []
        for key, e in found:
            if self._entries.get(key) is e:
                del self._entries[key]
                e.shard.used -= e.length
                self._used -= e.length
                gone.append((key, e))
        return gone

    def _release(self, gone: list[tuple[BlockKey, Entry]]) -> None:
        """Free the extents of forgotten entries that the index no longer names, now or,
        for one being read, when its last reader is done. Caller holds the lock."""
        for _, e in gone:
            e.dead = True
            if e.readers == 0:
                e.shard.data.free(e.file_no, e.offset, e.length)

    def _unread(self, e: Entry) -> None:
        e.readers -= 1
        if e.dead and e.readers == 0:
            e.shard.data.free(e.file_no, e.offset, e.length)

    def _stamps(self, n: int) -> list[float]:
        """``n`` wall-clock times, strictly increasing across calls, so recovery
        reproduces access order (one lock and one clock read per batch)."""
        with self._lock:
            return self._stamps_locked(n)

    def _stamps_locked(self, n: int) -> list[float]:
        first = max(time.time(), self._clock_last + 1e-6)
        out = [first + i * 1e-6 for i in range(n)]
        if out:
            self._clock_last = out[-1]
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"NVMe tier {self.name} is closed")

