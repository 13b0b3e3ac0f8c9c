"""Batched block copies between callers' buffers and one region: the DRAM tier's arena
(``tiers/dram.py``), and the cache client's same-host path (the server's arena mapped
here, or the client's staging region).

Every block of a batch moves between a caller's buffer and the region at a known offset. Blocks that sit back
to back both in the region and in the caller's memory are copied as one range: a
single large memcpy streams with non-temporal stores, many block-sized ones do not
(measured here: 64 MiB as one copy ≈ 1.4-1.7x the rate of 256 KiB pieces). Host copies
are ``memmove`` calls on raw addresses (ctypes releases the GIL around them), so a
large batch shared out in 4 MiB pieces between the calling thread and a helper copies
in parallel, and no per-block numpy view is built. Device buffers are copied one by one (one H2D/D2H copy each).

:func:`copy_batch_hashed` copies the same way and returns the XXH3-64 of every block's
destination (or source) bytes, hashed right after each block (in pieces of at most
``HASH_PIECE``) is copied, while it is still in cache, so verification does not cost a
second pass over memory (``benchmarks/dram.py``, ``benchmarks/server.py``).

Ownership: callers keep every buffer and the region mapped until the call returns;
nothing is kept afterwards. Thread-safe (no shared state).
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import Executor
from typing import Any, Sequence

import numpy as np
import xxhash

from kvstore.buffers.pinning import HostPin
from kvstore.buffers.device import copy_device_pairs
from kvstore.buffers.views import host_view, is_device
from kvstore.errors import BufferSizeError

PARALLEL_BYTES = 8 << 20   # below this a batch is copied by the calling thread alone
CHUNK_BYTES = 4 << 20      # large batches are shared out between threads in pieces of this size
HASH_PIECE = 4 << 20       # copied then hashed while in cache (L2 2 MiB per core, L3 32 MiB here)
_memmove = ctypes.memmove
_Run = list  # [caller address, region address, nbytes]


def host_address(buf: Any, writable: bool) -> tuple[int, int]:
    """``(address, nbytes)`` of a host buffer's bytes (contiguous numpy arrays without
    building a view; anything else through :func:`host_view`)."""
    if type(buf) is np.ndarray and buf.flags.c_contiguous and (buf.flags.writeable or not writable):
        return buf.ctypes.data, buf.nbytes
    v = host_view(buf, writable=writable)
    return v.ctypes.data, v.nbytes


def plan(bufs: Sequence[Any], sizes: Sequence[int], region_address: int, offsets: Sequence[int],
         writable: bool) -> tuple[list[_Run], list[tuple[Any, int, int]]]:
    """Host runs ``[buffer address, region address, nbytes]`` with adjacent blocks
    merged, and device buffers as ``(buf, offset, nbytes)``. ``writable``: the buffers
    are destinations. Raises :class:`BufferSizeError` where a buffer's size is not
    ``sizes[i]``."""
    runs: list[_Run] = []
    device: list[tuple[Any, int, int]] = []
    last: _Run | None = None
    for buf, n, off in zip(bufs, sizes, offsets):
        if is_device(buf):
            device.append((buf, off, n))
            continue
        a, nb = host_address(buf, writable)
        if nb != n:
            raise BufferSizeError(f"buffer has {nb} bytes, block has {n}")
        r = region_address + off
        if last is not None and last[0] + last[2] == a and last[1] + last[2] == r:
            last[2] += n
        else:
            last = [a, r, n]
            runs.append(last)
    return runs, device


def _chunks(runs: list[_Run], size: int) -> list[_Run]:
    """Runs cut into pieces of at most ``size`` bytes."""
    out: list[_Run] = []
    for a, r, n in runs:
        for pos in range(0, n, size):
            out.append([a + pos, r + pos, min(size, n - pos)])
    return out


def _move(runs: list[_Run], to_region: bool) -> None:
    if to_region:
        for a, r, n in runs:
            _memmove(r, a, n)
    else:
        for a, r, n in runs:
            _memmove(a, r, n)


class _Shared:
    """Chunks claimed one at a time by the caller and the helper threads. The caller
    never waits for a helper that has not started: it copies whatever is still
    unclaimed itself and then waits only for chunks a helper is copying. (On a busy
    host a woken helper can start milliseconds late; a fixed split would wait for it.)
    ``move`` does one chunk (default: a plain copy of a run)."""

    def __init__(self, chunks: list, to_region: bool, move: Any = None) -> None:
        self.chunks, self.to_region = chunks, to_region
        self.move = move or (lambda chunk: _move([chunk], to_region))
        self.next = 0
        self.busy = 0
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.idle = threading.Event()

    def work(self) -> None:
        chunks, lock = self.chunks, self.lock
        while True:
            with lock:
                i = self.next
                if i >= len(chunks) or self.error is not None:
                    return
                self.next = i + 1
                self.busy += 1
            try:
                self.move(chunks[i])
            except BaseException as exc:
                self.error = exc
            finally:
                with lock:
                    self.busy -= 1
                    if self.busy == 0 and (self.next >= len(chunks) or self.error is not None):
                        self.idle.set()


def copy_runs(runs: list[_Run], to_region: bool, pool: Executor | None, threads: int) -> None:
    """Copy host runs (from :func:`plan`) into the region (``to_region``) or out of it;
    ``pool`` lends up to ``threads - 1`` helpers for a large batch."""
    total = sum(r[2] for r in runs)
    if pool is None or threads < 2 or total < PARALLEL_BYTES:
        _move(runs, to_region)
        return
    shared = _Shared(_chunks(runs, CHUNK_BYTES), to_region)
    for _ in range(threads - 1):
        pool.submit(shared.work)
    shared.work()
    shared.idle.wait()
    if shared.error is not None:
        raise shared.error


def copy_device(device: list[tuple[Any, int, int]], region: np.ndarray, to_region: bool,
                pin: HostPin | None = None) -> None:
    """Device buffers to or from ``region``: one batch per device on its copier's stream
    (asynchronous copies, one wait), straight from the region where ``pin`` registers it
    with CUDA (on this first device copy), else through the copier's pinned ring."""
    if not device:
        return
    pinned = pin is not None and pin.ensure()
    pairs = [((region[off:off + n], buf) if to_region else (buf, region[off:off + n])) for buf, off, n in device]
    copy_device_pairs(pairs, pinned=pinned)


def _hash_at(address: int, nbytes: int) -> int:
    return xxhash.xxh3_64_intdigest((ctypes.c_char * nbytes).from_address(address))


def _copy_hash(a: int, r: int, n: int, to_region: bool, source: bool) -> int:
    """Copy one block and return the XXH3-64 of its destination bytes (``source``: of
    its source bytes), hashing each piece right after copying it."""
    src, dst = (a, r) if to_region else (r, a)
    side = src if source else dst
    if n <= HASH_PIECE:
        _memmove(dst, src, n)
        return _hash_at(side, n)
    h = xxhash.xxh3_64()
    for pos in range(0, n, HASH_PIECE):
        k = min(HASH_PIECE, n - pos)
        _memmove(dst + pos, src + pos, k)
        h.update((ctypes.c_char * k).from_address(side + pos))
    return h.intdigest()


def copy_batch_hashed(bufs: Sequence[Any], sizes: Sequence[int], region: np.ndarray, region_address: int,
                      offsets: Sequence[int], to_region: bool, pool: Executor | None, threads: int,
                      pin: HostPin | None = None, *, hash_source: bool = False) -> list[int]:
    """:func:`copy_batch`, block by block, returning per block the XXH3-64
    (:func:`kvstore.block.checksum`) of the bytes now at its destination (with
    ``hash_source``, of its source: a sender's checksum, taken before the bytes left);
    for a device buffer, of the region's side (host memory) after the copy."""
    sums = [0] * len(bufs)
    host: list[tuple[int, int, int, int]] = []   # (index, caller address, region address, nbytes)
    device: list[tuple[Any, int, int]] = []
    device_idx: list[int] = []
    for i, (buf, n, off) in enumerate(zip(bufs, sizes, offsets)):
        if is_device(buf):
            device.append((buf, off, n))
            device_idx.append(i)
            continue
        a, nb = host_address(buf, not to_region)
        if nb != n:
            raise BufferSizeError(f"buffer has {nb} bytes, block has {n}")
        host.append((i, a, region_address + off, n))

    def move(item: tuple[int, int, int, int]) -> None:
        i, a, r, n = item
        sums[i] = _copy_hash(a, r, n, to_region, hash_source)

    if pool is None or threads < 2 or sum(h[3] for h in host) < PARALLEL_BYTES:
        for item in host:
            move(item)
    else:
        shared = _Shared(host, to_region, move)
        for _ in range(threads - 1):
            pool.submit(shared.work)
        shared.work()
        shared.idle.wait()
        if shared.error is not None:
            raise shared.error
    copy_device(device, region, to_region, pin)
    for i, (_, off, n) in zip(device_idx, device):
        sums[i] = _hash_at(region_address + off, n)
    return sums


def hash_ranges(region_address: int, offsets: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """XXH3-64 of ``sizes[i]`` bytes at ``region_address + offsets[i]`` (ranges the
    caller holds inside a mapped region)."""
    return [_hash_at(region_address + off, n) for off, n in zip(offsets, sizes)]


def copy_batch(bufs: Sequence[Any], sizes: Sequence[int], region: np.ndarray, region_address: int,
               offsets: Sequence[int], to_region: bool, pool: Executor | None, threads: int,
               pin: HostPin | None = None) -> None:
    """Copy ``bufs[i]`` into ``region[offsets[i]:+sizes[i]]`` (``to_region``) or back.
    The caller has checked every range lies inside ``region``. ``pin``: the region's CUDA
    registration, for device buffers."""
    runs, device = plan(bufs, sizes, region_address, offsets, writable=not to_region)
    copy_runs(runs, to_region, pool, threads)
    copy_device(device, region, to_region, pin)
