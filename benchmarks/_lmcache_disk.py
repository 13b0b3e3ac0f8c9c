"""LMCache 0.5.6's disk paths, measured for ``benchmarks/nvme.py`` (run by a Python that
has LMCache installed; prints one JSON line with ``write_Bps`` and ``read_Bps``).

Both modes end the timed write phase with ``sync`` (the data on the disk), as
``benchmarks/nvme.py`` does for every contender.

``--mode disk``: the in-process ``LocalDiskBackend`` (one file per chunk), writes
through ``batched_submit_put_task`` (waiting for every completion callback), cold reads
(files dropped from the page cache first) through ``batched_get_blocking``. Its
``use_odirect`` option is left off: on a machine without CUDA its CPU allocator's
buffers are not page-aligned, every O_DIRECT write fails with EINVAL inside its worker
and no block is ever stored.
``--mode fs-native``: the ``fs_native`` L2 adapter (LMCache's C++ file-system
connector, the disk tier of its multiprocess server) with ``use_odirect`` and the
server's default 4 I/O workers, driven in-process through its L2 adapter interface
(``submit_store_task`` / ``submit_load_task``, polled to completion) from page-aligned
buffers, so what is measured is its disk path without the server's L1 and IPC.
That set-up is :class:`FsNative`, which ``benchmarks/nvme_paired.py`` uses too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import threading
import time


def drop_cache(directory: str) -> None:
    """Evict every file under ``directory`` from the page cache (cold reads)."""
    os.sync()
    for dirpath, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_disk(args: argparse.Namespace) -> dict:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_allocators.host_memory_allocator import HostMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    total = args.block * args.blocks
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=256, local_disk=args.dir, max_local_disk_size=total * 2 / 1024**3,
        local_cpu=False, extra_config={"use_odirect": False}, lmcache_instance_id="bench")
    allocator = HostMemoryAllocator(total * 2 + (64 << 20))
    cpu = LocalCPUBackend(config, memory_allocator=allocator)
    disk = LocalDiskBackend(config=config, loop=loop, local_cpu_backend=cpu, dst_device="cpu")
    shape = torch.Size([args.block])
    keys = [CacheEngineKey("bench", 1, 0, i, torch.uint8) for i in range(args.blocks)]
    objs = []
    for i in range(args.blocks):
        obj = cpu.allocate(shape, torch.uint8, MemoryFormat.BINARY)
        obj.tensor.fill_(i % 251)   # in LMCache's own pool, as its engine hands them over
        objs.append(obj)
    done = threading.Semaphore(0)
    t0 = time.perf_counter()
    for s in range(0, args.blocks, args.batch):
        disk.batched_submit_put_task(keys[s:s + args.batch], objs[s:s + args.batch],
                                     on_complete_callback=lambda _k: done.release())
        for _ in keys[s:s + args.batch]:
            if not done.acquire(timeout=60):
                raise RuntimeError("LocalDiskBackend never completed a write")
    os.sync()   # its writes land in the page cache: the write-back is part of writing to disk
    t_write = time.perf_counter() - t0
    for obj in objs:
        obj.ref_count_down()
    drop_cache(disk.path)
    t0 = time.perf_counter()
    got = 0
    for s in range(0, args.blocks, args.batch):
        out = disk.batched_get_blocking(keys[s:s + args.batch])
        for obj in out:
            if obj is not None:
                got += 1
                obj.ref_count_down()
    t_read = time.perf_counter() - t0
    if got != args.blocks:
        raise RuntimeError(f"LocalDiskBackend returned {got} of {args.blocks} blocks")
    disk.close()
    return {"write_Bps": total / t_write, "read_Bps": total / t_read}


class FsNative:
    """LMCache's ``fs_native`` L2 adapter with O_DIRECT on ``directory``, driven through
    its L2 adapter interface, with page-aligned source and destination objects for
    ``n`` blocks of ``block`` bytes from LMCache's own tensor allocator."""

    def __init__(self, directory: str, block: int, n: int) -> None:
        import numpy as np
        import torch
        from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat

        total = block * n
        raw = np.zeros(2 * total + (8 << 20), np.uint8)
        start = (-raw.ctypes.data) % 4096
        allocator = TensorMemoryAllocator(torch.from_numpy(raw[start:start + 2 * total + (4 << 20)]))
        self.directory = directory
        self.adapter = self._open()
        shape = torch.Size([block])
        self.src = [allocator.allocate(shape, torch.uint8, MemoryFormat.BINARY) for _ in range(n)]
        self.dst = [allocator.allocate(shape, torch.uint8, MemoryFormat.BINARY) for _ in range(n)]
        for obj in self.dst:
            obj.tensor.zero_()

    def _open(self):
        from lmcache.v1.distributed.l2_adapters.fs_native_l2_adapter import (
            FSNativeL2AdapterConfig, _create_fs_native_l2_adapter)
        return _create_fs_native_l2_adapter(FSNativeL2AdapterConfig.from_dict(
            {"base_path": self.directory, "use_odirect": True}))

    def renew(self) -> None:
        """Close the adapter, delete its files and open a new one on the empty directory."""
        self.adapter.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        self.adapter = self._open()

    @staticmethod
    def keys(first: int, n: int) -> list:
        from lmcache.v1.distributed.api import ObjectKey
        return [ObjectKey(i.to_bytes(32, "little"), "bench", 0) for i in range(first, first + n)]

    def store(self, keys: list, objs: list) -> None:
        """Store ``objs`` under ``keys``; returns once every file is written."""
        task = self.adapter.submit_store_task(keys, objs)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done = self.adapter.pop_completed_store_tasks()
            if task in done:
                if not done[task].is_successful():
                    raise RuntimeError("fs_native store failed")
                return
            time.sleep(0.0002)
        raise RuntimeError("fs_native store never completed")

    def load(self, keys: list, objs: list) -> None:
        """Load ``keys`` into ``objs``; returns once every one has arrived."""
        task = self.adapter.submit_load_task(keys, objs)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            bits = self.adapter.query_load_result(task)
            if bits is not None:
                got = sum(1 for i in range(len(keys)) if bits.test(i))
                if got != len(keys):
                    raise RuntimeError(f"fs_native loaded {got} of {len(keys)}")
                return
            time.sleep(0.0002)
        raise RuntimeError("fs_native load never completed")

    def close(self) -> None:
        self.adapter.close()


def run_fs_native(args: argparse.Namespace) -> dict:
    import torch

    total = args.block * args.blocks
    fs = FsNative(args.dir, args.block, args.blocks)
    keys = fs.keys(0, args.blocks)
    for i, obj in enumerate(fs.src):
        obj.tensor.fill_(i % 251)
    t0 = time.perf_counter()
    for s in range(0, args.blocks, args.batch):
        fs.store(keys[s:s + args.batch], fs.src[s:s + args.batch])
    os.sync()   # as every contender's write phase ends
    t_write = time.perf_counter() - t0
    drop_cache(args.dir)
    t0 = time.perf_counter()
    for s in range(0, args.blocks, args.batch):
        fs.load(keys[s:s + args.batch], fs.dst[s:s + args.batch])
    t_read = time.perf_counter() - t0
    if not torch.equal(fs.dst[1].tensor, fs.src[1].tensor):
        raise RuntimeError("fs_native returned different bytes")
    fs.close()
    return {"write_Bps": total / t_write, "read_Bps": total / t_read}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("disk", "fs-native"), required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--block", type=int, required=True)
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    result = run_disk(args) if args.mode == "disk" else run_fs_native(args)
    print(json.dumps(result), flush=True)
    os._exit(0)   # LMCache leaves non-daemon threads behind


if __name__ == "__main__":
    sys.exit(main())
