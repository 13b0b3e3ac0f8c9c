"""Host DRAM tier: one page-aligned arena carved into slots.

The arena is a single ``mmap`` (anonymous, or a file under ``/dev/shm`` when the cache
server shares it with local clients), backed by transparent huge pages where the
kernel allows, pre-faulted at start-up and pinned through CUDA on its first device copy
(:class:`kvstore.buffers.pinning.HostPin`), so blocks move with one memcpy and no allocation per
block.

Every slot keeps the XXH3-64 (:func:`kvstore.block.checksum`) of its bytes, hashed as
they are copied in (piece by piece while in cache: a few percent of the copy). Reads
hash what they copied out and compare, so a byte flipped in the arena (memory errors,
a stray write through the shared mapping) is a miss: the slot is dropped and
``corrupt_blocks`` rises. The cache server sends these checksums to its clients,
which verify the bytes they receive (``docs/protocol.md``).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np

from kvstore.buffers.framed import framed_spans
from kvstore.buffers.host import copy_batch_hashed, hash_ranges
from kvstore.buffers.pinning import HostPin, _torch_cudart
from kvstore.buffers import nbytes_of
from kvstore.config.tiers import DramTierConfig
from kvstore.errors import ConfigError, InvalidArgumentError
from kvstore.keys import BlockKey
from kvstore.tiers._arena import ArenaTier, SlotIndex
from kvstore.tiers._prefault import prefault
from kvstore.tiers.base import HostArena, TierCapabilities, check_batch, check_sizes

log = logging.getLogger(__name__)
_D = DramTierConfig.defaults()   # keyword defaults: the config model's (one definition)
PAGE = mmap.PAGESIZE
SLOT_ALIGN = 4096  # slots stay O_DIRECT-aligned so NVMe I/O can use them in place
# With header frames, the arena has room for a frame per block of at least this size.
FRAMED_MIN_BLOCK = 64 << 10
# Large batches copy on two threads (memmove releases the GIL): one thread's memcpy does
# not reach the memory bandwidth (11-14 GB/s one thread, ~23 GB/s two, on these VMs).
# The copies are kvstore.buffers.host's, shared with the cache client's same-host path.
_COPY_THREADS = min(2, os.cpu_count() or 1)
_copy_pool: ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()
_cudart = _torch_cudart   # how the DRAM tier finds CUDA's runtime (tests swap in a stand-in)


def _map_arena(size: int, shm_path: str | None, fault_bytes: int | None = None, *,
               name: str = "dram") -> tuple[mmap.mmap, int | None]:
    """The arena: anonymous memory, or a shared file at ``shm_path`` (see
    :func:`_claim_shared`, whose descriptor, holding the file's lock, comes back too),
    backed by transparent huge pages where the kernel allows them, and its first
    ``fault_bytes`` (default: all) faulted in now, with progress for the tier ``name``
    (:func:`kvstore.tiers._prefault.prefault`).

    Huge pages are asked for before the first touch (a page faulted in small stays small
    until khugepaged gets to it). They matter for NVMe I/O, not only for TLB misses: an
    O_DIRECT read of a 4 MiB block into 4 KiB pages hands the disk driver 1024 separate
    pages, which it splits into several requests; into 2 MiB pages it is one or two. On
    these VMs that alone took cold NVMe reads of 4 MiB blocks into the arena from 1.1 to
    2.2 GB/s (``benchmarks/nvme_dram.py``). Shared files get them only where
    ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows.
    """
    lock_fd = None
    if shm_path:
        lock_fd = _claim_shared(shm_path, size)
        try:
            mm = mmap.mmap(lock_fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(lock_fd)
            raise
    else:
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no transparent huge pages here: small pages work too
        pass
    prefault(mm, fault_bytes, name=name)  # fault the pages in now, not on first use
    return mm, lock_fd


def _claim_shared(path: str, size: int) -> int:
    """Open (creating it when absent) the arena file at ``path`` for this process alone
    and size it: never through a symlink, only a regular file this user owns that no
    one else may read or write, never one another live process holds (an exclusive
    ``flock`` held until the tier closes; a file left by a dead process is reused), and
    only when the file system has room (tmpfs would otherwise kill the process with
    SIGBUS on first touch). Returns the descriptor, which holds the lock."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        try:
            fd = os.open(path, flags)
        except OSError as exc:   # ELOOP: a symlink
            raise ConfigError(f"shm_path {path!r} cannot be used: {exc.strerror} (symlinks are refused)") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError(f"shm_path {path!r} is not a private file of this user (mode {st.st_mode & 0o777:o}, "
                              f"owner {st.st_uid}); remove it or choose another path")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"shm_path {path!r} is in use by another live kvstore process") from None
        vfs = os.statvfs(os.path.dirname(os.path.abspath(path)))
        free = vfs.f_bavail * vfs.f_frsize + st.st_size
        if free < size:
            raise ConfigError(f"shm_path {path!r}: the arena needs {size} bytes but its file system has {free} "
                              "free; lower the tier's capacity or grow the tmpfs")
        os.ftruncate(fd, 0)           # a dead process's bytes are never served
        os.ftruncate(fd, size)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _pool() -> ThreadPoolExecutor:
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None:
            _copy_pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-copy")
        return _copy_pool


class DramTier(ArenaTier, HostArena):
    """Blocks in one pre-faulted host arena of ``capacity_bytes``.

    ``shm_path``: back the arena with this file (e.g. ``/dev/shm/kvstore-main``) so other
    processes can map it; otherwise anonymous memory. ``pin``: register the arena with
    CUDA (default: when CUDA is available). A :class:`HostArena` that also lends
    :meth:`slots` and fills :meth:`reserve` in place (see its capabilities). Thread-safe; copies run outside the lock,
    protected by per-slot reader counts so a slot is never reused mid-copy.

    ``header_frames`` (set by the Store's build when a Mooncake tier is next below, not
    a config key): each slot keeps one page before its payload, and :meth:`lend` hands
    out views whose frame is that page, so the spill sends each block's header and
    payload as one contiguous piece (Mooncake pays per piece: two pieces put 0.84-0.90x
    of one, ``benchmarks/cluster.py``). The pages are not counted against the capacity:
    the arena has room for one per block down to :data:`FRAMED_MIN_BLOCK` (a page per
    1 MiB block is 0.4 % more memory).
    """

    def __init__(self, capacity_bytes: int, *, name: str = "dram", shm_path: str | None = _D.shm_path,
                 pin: bool | None = _D.pin, header_frames: bool = False) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgumentError(f"DRAM tier capacity must be positive, got {capacity_bytes}")
        self.name = name
        self._capacity = int(capacity_bytes)
        size = -(-self._capacity // PAGE) * PAGE
        frame = SLOT_ALIGN if header_frames else 0
        # frames come on top of the capacity: room for one per block down to FRAMED_MIN_BLOCK
        # (smaller blocks fill the arena first, as fragmentation would); in anonymous
        # memory that room is faulted in only as slots reach it (a shared file's is faulted
        # in now: a page of a full tmpfs first touched later would be a SIGBUS)
        arena = size + frame * (size // FRAMED_MIN_BLOCK + 1)
        self.shm_path = shm_path
        self._mmap, self._lock_fd = _map_arena(arena, shm_path, fault_bytes=None if shm_path else size, name=name)
        self.arena = np.frombuffer(self._mmap, dtype=np.uint8)
        self._readonly = self.arena.view()
        self._readonly.flags.writeable = False
        self._pin = None if pin is False else HostPin(self._mmap, self.arena.ctypes.data, self.arena.nbytes,
                                                      name=name, shared=bool(shm_path), cudart=_cudart)
        self._index = SlotIndex(self._capacity, arena, SLOT_ALIGN, frame_bytes=frame)
        self.header_frames = bool(header_frames)
        self._close_lock = threading.Lock()
        self._corrupt = 0           # slots whose bytes no longer matched their checksum
        self._refused = 0           # reserved blocks whose bytes did not match the writer's checksum
        self.capabilities = TierCapabilities(device="cpu", alignment=SLOT_ALIGN, max_concurrency=1,
                                             zero_copy_view=True, write_checksums=True, reserve=True,
                                             slots=True, host_arena=True)

    @property
    def pinned(self) -> bool:
        """Whether the arena is registered with CUDA (it is on its first device copy,
        unless ``pin`` is False or there is no GPU)."""
        return self._pin is not None and self._pin.pinned

    def read_into(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> list[bool]:
        check_batch(keys, dsts)
        slots = self._index.acquire_many(keys)  # one lock hold pins the whole batch
        try:
            check_sizes(self.name, dsts, slots)
            held = [(i, slot, dst) for i, (slot, dst) in enumerate(zip(slots, dsts)) if slot is not None]
            sums = self._copy([d for _, _, d in held], [s.offset for _, s, _ in held],
                              [s.nbytes for _, s, _ in held], to_arena=False)
        finally:
            self._index.release_many(slots)
        out = [slot is not None for slot in slots]
        for (i, slot, _), csum in zip(held, sums):
            if csum != slot.checksum:
                out[i] = False
                self._drop_corrupt(keys[i], slot, "read")
        return out

    def _drop_corrupt(self, key: BlockKey, slot: Any, what: str) -> None:
        if self._index.drop_slot(key, slot):
            self._corrupt += 1
            log.warning("DRAM tier %s: block %r failed its checksum on %s; dropped", self.name, key, what)

    def write(self, keys: Sequence[BlockKey], srcs: Sequence[Any],
              checksums: Sequence[int | None] | None = None) -> list[bool]:
        """Store a copy of each source. ``checksums`` (one per source, ``None``: none
        given): the XXH3-64 its writer vouched for (a client's, or the slot a spill comes
        from); a copy whose bytes, as they landed in the slot, do not match is freed and
        refused (``False``, counted in ``refused_writes``): a source changed by someone
        else between its check and this copy is never stored under a fresh checksum."""
        # Reserve every slot of the batch under one lock hold, so a batch lands in
        # adjacent slots when the arena has the room (same-host readers then copy it
        # as one range); copy outside the lock (device sources as one batch), publish
        # at the end.
        check_batch(keys, srcs)
        if checksums is not None:
            check_batch(keys, checksums, "checksums")
        sizes = [nbytes_of(src) for src in srcs]
        reserved = self._index.reserve_many(keys, sizes)
        held = [(j, entry, src) for j, (entry, src) in enumerate(zip(reserved, srcs)) if isinstance(entry, tuple)]
        try:
            got = self._copy([src for _, _, src in held], [e[0] for _, e, _ in held], [e[1] for _, e, _ in held],
                             to_arena=True)
        except BaseException:
            self._index.abort_many(reserved)
            raise
        sums: list[int | None] = [None] * len(keys)
        bad = []
        for (j, entry, _), csum in zip(held, got):
            if checksums is not None and checksums[j] is not None and checksums[j] != csum:
                bad.append(entry)
                reserved[j] = None
            sums[j] = csum
        if bad:
            self._index.abort_many(bad)
            self._refused += len(bad)
            log.warning("DRAM tier %s: %d blocks did not match their writer's checksum once copied; refused",
                        self.name, len(bad))
        return self._index.commit_many(keys, reserved, sums)

    def _copy(self, bufs: list[Any], offsets: list[int], sizes: list[int], *, to_arena: bool) -> list[int]:
        """Copy host buffers block by block (two threads for a large batch), device
        buffers as one batch per device on its copy stream (the arena is pinned where
        CUDA is); returns the XXH3-64 of each block's destination bytes (for device
        buffers, of the arena's side)."""
        return copy_batch_hashed(bufs, sizes, self.arena, self.arena.ctypes.data, offsets, to_arena, _pool(),
                                 _COPY_THREADS, self._pin)

    def checksums(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """The stored checksum (XXH3-64) of each key's block, ``None`` where absent. The
        cache server sends it with the block; ``view`` users verify against it."""
        return self._index.checksums(keys)

    @contextmanager
    def view(self, key: BlockKey) -> Iterator[np.ndarray | None]:
        """A read-only view of one block, verified against its checksum first (the Store
        spills through it, handing :meth:`checksums` to the lower tier). A block that
        fails is dropped and yields ``None``."""
        with self.views([key]) as got:
            yield got[0]

    @contextmanager
    def views(self, keys: Sequence[BlockKey], *, verify: bool = True) -> Iterator[list[np.ndarray | None]]:
        """Read-only views of many blocks (``None`` where absent), their slots held under
        one lock round trip each way until the ``with`` exits. Each block is verified
        against its checksum first: one that fails is dropped (counted in
        ``corrupt_blocks``) and its entry is ``None``, a miss. ``verify=False`` only for
        a caller that sends :meth:`checksums` along to a reader that verifies the bytes
        it receives (the cache server's clients)."""
        with self._held(keys, verify, "borrow") as slots:
            yield self._views_of(slots)

    @contextmanager
    def lend(self, keys: Sequence[BlockKey]) -> Iterator[tuple[list[np.ndarray | None], list[int | None]]]:
        """:meth:`views` with the checksum each slot was verified against (see
        :meth:`Tier.lend`). With ``header_frames``, each view is a
        :class:`~kvstore.buffers.framed.FramedView` whose frame is its slot's: a tier
        below (Mooncake) writes the block header there and sends header and payload as
        one piece."""
        with self._held(keys, True, "borrow") as slots:
            yield self._framed_views_of(slots), [s.checksum if s is not None else None for s in slots]

    def _views_of(self, slots: Sequence[Any]) -> list[np.ndarray | None]:
        ro = self._readonly
        return [ro[s.offset:s.offset + s.nbytes] if s is not None else None for s in slots]

    def _framed_views_of(self, slots: Sequence[Any]) -> list[np.ndarray | None]:
        """:meth:`_views_of`, each with its slot's header frame (``header_frames``)."""
        if not self.header_frames:
            return self._views_of(slots)
        return framed_spans(self.arena, self._readonly, [(s.offset, s.nbytes) if s is not None else None
                                                         for s in slots], self._index.frame_bytes)

    @contextmanager
    def slots(self, keys: Sequence[BlockKey], *, verify: bool = True) -> Iterator[list[tuple[int, int] | None]]:
        """``(offset, nbytes)`` inside the arena of many blocks (``None`` where absent),
        held and verified like :meth:`views`: for a process that maps the arena itself
        (the cache server's same-host clients), without building a view per block."""
        with self._held(keys, verify, "borrow") as slots:
            yield [(s.offset, s.nbytes) if s is not None else None for s in slots]

    @contextmanager
    def _held(self, keys: Sequence[BlockKey], verify: bool, what: str) -> Iterator[list[Any]]:
        """The keys' slots with a reader held on each until the ``with`` exits; with
        ``verify``, a slot whose bytes no longer match its checksum is dropped and
        given as ``None``."""
        slots = self._index.acquire_many(keys)
        try:
            shown = slots
            if verify:
                held = [(i, s) for i, s in enumerate(slots) if s is not None]
                sums = hash_ranges(self.arena.ctypes.data, [s.offset for _, s in held], [s.nbytes for _, s in held])
                bad = [i for (i, s), csum in zip(held, sums) if csum != s.checksum]
                if bad:
                    shown = list(slots)
                    for i in bad:
                        shown[i] = None
                        self._drop_corrupt(keys[i], slots[i], what)  # freed once our reader is released
            yield shown
        finally:
            self._index.release_many(slots)

    def reserve(self, keys: Sequence[BlockKey], sizes: Sequence[int]) -> "SlotReservation":
        """Reserve slots that a caller fills in place (e.g. a one-sided network transfer
        writing straight into the arena), then publishes with ``commit()``.

        Keys already stored, and keys that do not fit, get no slot (``views[i] is None``).
        Reserved bytes count as used at once; nothing is visible to readers until
        ``commit()``. The caller must end the reservation with exactly one of
        ``commit()``, ``abort()`` or ``abandon()``."""
        check_batch(keys, sizes, "sizes")
        sizes = [int(n) for n in sizes]
        for n in sizes:
            if n <= 0:
                raise InvalidArgumentError(f"[{self.name}] block size must be positive, got {n}")
        return SlotReservation(self, list(keys), self._index.reserve_many(keys, sizes))

    def stats(self) -> dict[str, Any]:
        return {"pinned": self.pinned, "shared_memory": bool(self.shm_path), "header_frames": self.header_frames,
                "corrupt_blocks": self._corrupt,
                "refused_writes": self._refused,
                "largest_free_bytes": self._index.largest_free(), "abandoned_bytes": self._index.abandoned_bytes}

    def close(self) -> None:
        with self._close_lock:
            if self._mmap is None:
                return
            self._index.clear()
            mm, self._mmap = self._mmap, None
        if self._pin is not None:
            self._pin.release()       # before unmapping: a new arena may land at this address
        self.arena = self._readonly = np.empty(0, dtype=np.uint8)
        try:
            mm.close()
        except BufferError:  # a view is still exported; the GC unmaps it later
            pass
        if self.shm_path:
            try:
                os.unlink(self.shm_path)      # still ours: we hold its lock
            except FileNotFoundError:
                pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


class SlotReservation:
    """Arena slots reserved by :meth:`DramTier.reserve`: the tier's part of a Store
    reservation (:class:`kvstore.store.reservation.Reservation`) or of a NIXL write into the
    arena. ``views[i]`` is a writable arena view for ``keys[i]`` or ``None`` (already
    stored, or no room). Not thread-safe: one owner fills the views, then ends the
    reservation once."""

    def __init__(self, tier: DramTier, keys: list[BlockKey], reserved: list) -> None:
        self._tier, self._keys, self._reserved = tier, keys, reserved
        self.views: list[np.ndarray | None] = [
            tier.arena[e[0]:e[0] + e[1]] if isinstance(e, tuple) else None for e in reserved]
        self._done = False

    def commit(self, checksums: Sequence[int | None] | None = None) -> list[bool]:
        """Publish the filled slots, each with the checksum of the bytes in it. With
        ``checksums`` (the writer's, one per key), a slot whose bytes differ is freed
        instead (counted in ``refused_writes``). Per key: True when stored now or already
        stored before, False when there was no room or its bytes were refused."""
        self._finish()
        tier, reserved = self._tier, list(self._reserved)
        held = [(j, e) for j, e in enumerate(reserved) if isinstance(e, tuple)]
        got = hash_ranges(tier.arena.ctypes.data, [e[0] for _, e in held], [e[1] for _, e in held])
        sums: list[int | None] = [None] * len(reserved)
        bad = []
        for (j, e), csum in zip(held, got):
            if checksums is not None and checksums[j] is not None and checksums[j] != csum:
                bad.append(e)
                reserved[j] = None
            sums[j] = csum
        if bad:
            tier._index.abort_many(bad)
            tier._refused += len(bad)
            log.warning("DRAM tier %s: %d reserved blocks did not match their writer's checksum; refused",
                        tier.name, len(bad))
        return tier._index.commit_many(self._keys, reserved, sums)

    def abort(self) -> None:
        """Free every reserved slot; nothing is stored."""
        self._finish()
        self._tier._index.abort_many(self._reserved)

    def abandon(self) -> None:
        """Keep the slots reserved for good and store nothing: a transfer that could not
        be cancelled may still write them, so they must never be reused."""
        self._finish()
        self._tier._index.abandon_many(self._reserved)

    def _finish(self) -> None:
        if self._done:
            raise InvalidArgumentError("reservation already ended")
        self._done = True
        self.views = [None] * len(self._reserved)
