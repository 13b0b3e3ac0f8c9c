"""The segmented checksum (:mod:`kvstore._segsum`) of device memory, by a cupy kernel.

NOT YET RUN ON A GPU. The kernel source is compiled and run on the host by the tests
(``tests/test_segsum.py`` builds it with a C++ compiler and a few lines standing in for
the CUDA built-ins) and checked there against the numpy reference; the CUDA launch
itself, and :func:`check_device_checksum`, have never run on a device.

Two launches, each one thread per work item, no shared memory and no barriers:

1. ``segsum_blocks``: one thread per (segment, 1 KiB block, lane). Inside a block XXH3's
   accumulators only add, so each thread sums its lane's terms over the block's 16
   stripes into ``partial[segment][block][lane]``.
2. ``segsum_finish``: one thread per segment. It walks the blocks in order (add the
   partial sums, scramble), adds the last partial block's stripes and the final stripe,
   merges the eight lanes and writes the segment's digest.

Only the digests (8 bytes per 64 KiB) come back to the host, where
:func:`kvstore._segsum.combine` folds them; the payload never leaves the device.

Nothing here imports cupy at module import; call only where CUDA is present.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np

from kvstore._segsum import (BLOCK_BYTES, LONG_MIN_BYTES, SEGMENT_BYTES, combine, long_path_keys, segment_count,
                             segment_digests, segmented_checksum)

THREADS = 256
# one uint64 table: stripe keys (16 x 8), then scramble, last-stripe and merge keys (8 each)
KEY_STRIPE, KEY_SCRAMBLE, KEY_LAST, KEY_MERGE = 0, 128, 136, 144

SOURCE = r"""
typedef unsigned long long u64;

__device__ __forceinline__ u64 lane_term(u64 word, u64 neighbour, u64 key) {
    u64 keyed = word ^ key;
    return (keyed & 0xFFFFFFFFull) * (keyed >> 32) + neighbour;
}

__device__ __forceinline__ u64 read64(const unsigned char* p) {   /* any alignment */
    u64 v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

__device__ __forceinline__ u64 fold128(u64 a, u64 b) {
    return (a * b) ^ __umul64hi(a, b);
}

/* partial[(g * max_blocks + b) * 8 + lane]: lane's sum over the 16 stripes of block b of segment g */
extern "C" __global__ void segsum_blocks(const unsigned char* data, u64 nbytes, u64 seg, u64 nseg,
                                         u64 max_blocks, const u64* keys, u64* partial) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= nseg * max_blocks * 8) return;
    u64 lane = t % 8, b = (t / 8) % max_blocks, g = t / (8 * max_blocks);
    u64 len = (g + 1 == nseg) ? nbytes - g * seg : seg;
    if (b >= (len - 1) / 1024) return;
    const u64* words = (const u64*)(data + g * seg + b * 1024);   /* 8-byte aligned: checked by the caller */
    u64 sum = 0;
    for (int s = 0; s < 16; ++s)
        sum += lane_term(words[s * 8 + lane], words[s * 8 + (lane ^ 1)], keys[KEY_STRIPE + s * 8 + lane]);
    partial[t] = sum;
}

extern "C" __global__ void segsum_finish(const unsigned char* data, u64 nbytes, u64 seg, u64 nseg,
                                         u64 max_blocks, const u64* keys, const u64* partial, u64* out) {
    u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= nseg) return;
    u64 len = (g + 1 == nseg) ? nbytes - g * seg : seg;
    const unsigned char* p = data + g * seg;
    u64 acc[8] = {0xC2B2AE3Dull, 0x9E3779B185EBCA87ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull,
                  0x85EBCA77C2B2AE63ull, 0x85EBCA77ull, 0x27D4EB2F165667C5ull, 0x9E3779B1ull};
    u64 blocks = (len - 1) / 1024;
    for (u64 b = 0; b < blocks; ++b)
        for (int i = 0; i < 8; ++i) {
            u64 a = acc[i] + partial[(g * max_blocks + b) * 8 + i];
            acc[i] = ((a ^ (a >> 47)) ^ keys[KEY_SCRAMBLE + i]) * 0x9E3779B1ull;
        }
    const u64* tail = (const u64*)(p + blocks * 1024);
    u64 stripes = (len - 1 - blocks * 1024) / 64;
    for (u64 s = 0; s < stripes; ++s)
        for (int i = 0; i < 8; ++i)
            acc[i] += lane_term(tail[s * 8 + i], tail[s * 8 + (i ^ 1)], keys[KEY_STRIPE + s * 8 + i]);
    const unsigned char* last = p + len - 64;   /* the final stripe: any alignment */
    for (int i = 0; i < 8; ++i)
        acc[i] += lane_term(read64(last + 8 * i), read64(last + 8 * (i ^ 1)), keys[KEY_LAST + i]);
    u64 h = len * 0x9E3779B185EBCA87ull;
    for (int i = 0; i < 8; i += 2)
        h += fold128(acc[i] ^ keys[KEY_MERGE + i], acc[i + 1] ^ keys[KEY_MERGE + i + 1]);
    h = (h ^ (h >> 37)) * 0x165667919E3779F9ull;
    out[g] = h ^ (h >> 32);
}
"""


def key_table() -> np.ndarray:
    """The ``uint64`` key table the kernels index (see ``KEY_*``)."""
    keys = long_path_keys()
    return np.concatenate([keys["stripe"].reshape(-1), keys["scramble"], keys["last"], keys["merge"]])


def launch_shape(nbytes: int) -> tuple[int, int]:
    """``(segments, max_blocks)`` of a payload: the partial-sum table is
    ``segments * max_blocks * 8`` words (the last segment holds up to ``2S - 1`` bytes)."""
    return segment_count(nbytes), (2 * SEGMENT_BYTES - 2) // BLOCK_BYTES


@functools.lru_cache(maxsize=None)
def _kernels(device: int) -> tuple[Any, Any, Any]:
    import cupy

    with cupy.cuda.Device(device):
        defines = f"#define KEY_STRIPE {KEY_STRIPE}\n#define KEY_SCRAMBLE {KEY_SCRAMBLE}\n" \
                  f"#define KEY_LAST {KEY_LAST}\n#define KEY_MERGE {KEY_MERGE}\n"
        module = cupy.RawModule(code=defines + SOURCE)
        return module.get_function("segsum_blocks"), module.get_function("segsum_finish"), cupy.asarray(key_table())


def device_digests(buf: Any) -> Any:
    """The segment digests of a contiguous CUDA buffer (torch tensor or cupy array), as a
    cupy ``uint64`` array on its device, computed on the current cupy stream. The payload
    must be at least 241 bytes and 8-byte aligned (:func:`device_checkable`)."""
    import cupy

    data = _as_cupy_bytes(buf)
    n = data.nbytes
    if not device_checkable(data.data.ptr, n):
        raise ValueError(f"device checksum needs an 8-byte aligned payload of at least {LONG_MIN_BYTES} bytes")
    nseg, max_blocks = launch_shape(n)
    with cupy.cuda.Device(data.device.id):
        blocks_kernel, finish_kernel, keys = _kernels(data.device.id)
        partial = cupy.empty(nseg * max_blocks * 8, dtype=cupy.uint64)
        out = cupy.empty(nseg, dtype=cupy.uint64)
        args = (data, np.uint64(n), np.uint64(SEGMENT_BYTES), np.uint64(nseg), np.uint64(max_blocks), keys)
        threads = nseg * max_blocks * 8
        blocks_kernel(((threads + THREADS - 1) // THREADS,), (THREADS,), args + (partial,))
        finish_kernel(((nseg + THREADS - 1) // THREADS,), (THREADS,), args + (partial, out))
    return out


def device_checkable(ptr: int, nbytes: int) -> bool:
    """Whether the kernel can hash a payload at device address ``ptr`` in place."""
    return nbytes >= LONG_MIN_BYTES and ptr % 8 == 0


def device_checksum(buf: Any) -> int:
    """The segmented checksum of a CUDA buffer; only the digests (8 bytes per segment)
    are copied to the host. A payload the kernel cannot take in place (shorter than 241
    bytes, unaligned) is copied to the host and hashed there (at most a few bytes in
    practice: KV blocks are large and allocator-aligned)."""
    data = _as_cupy_bytes(buf)
    if not device_checkable(data.data.ptr, data.nbytes):
        return segmented_checksum(data.get())
    return combine(device_digests(data).get())


def _as_cupy_bytes(buf: Any) -> Any:
    import cupy

    if hasattr(buf, "is_cuda"):   # a torch tensor: a flat byte view, shared memory
        from kvstore.buffers import device_view

        buf = device_view(buf)
    return cupy.asarray(buf).reshape(-1).view(cupy.uint8)


def check_device_checksum(sizes: tuple[int, ...] = (64 << 10, 256 << 10, 1 << 20, 4 << 20, (4 << 20) + 5, 1000),
                          repeats: int = 20) -> dict[str, Any]:
    """Run the kernel against the host implementation on the same random bytes, per
    payload size: digests and checksum equal, a flipped byte detected, and the device's
    and host's throughput (GB/s; host includes no copy, device includes the digest
    copy-back). Returns ``{"ok", "device", "segment_bytes", "rows": [{"nbytes",
    "digests_match", "checksum_match", "flip_detected", "device_gbps", "host_gbps"}],
    "error"}``; ``ok`` is False with ``error`` set where CUDA or cupy is missing."""
    result: dict[str, Any] = {"ok": False, "device": None, "segment_bytes": SEGMENT_BYTES, "rows": [], "error": None}
    try:
        import cupy

        if not cupy.is_available():
            raise RuntimeError("cupy finds no CUDA device")
        result["device"] = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
        rng = np.random.default_rng(18)
        for n in sizes:
            host = rng.integers(0, 256, n, dtype=np.uint8)
            dev = cupy.asarray(host)
            want = segmented_checksum(host)
            digests_ok = n < LONG_MIN_BYTES or device_digests(dev).get().tolist() == segment_digests(host).tolist()
            got = device_checksum(dev)
            dev[n // 2] ^= 1
            flipped = device_checksum(dev)
            dev[n // 2] ^= 1
            result["rows"].append({"nbytes": n, "digests_match": digests_ok, "checksum_match": got == want,
                                   "flip_detected": flipped != want, "device_gbps": _device_gbps(dev, repeats),
                                   "host_gbps": _host_gbps(host, repeats)})
        result["ok"] = all(r["digests_match"] and r["checksum_match"] and r["flip_detected"] for r in result["rows"])
    except Exception as exc:   # report, never raise: this feeds a benchmark table
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


def _device_gbps(dev: Any, repeats: int) -> float:
    import cupy

    device_checksum(dev)   # compile and warm up
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeats):
        device_checksum(dev)
    end.record()
    end.synchronize()
    return dev.nbytes * repeats / (cupy.cuda.get_elapsed_time(start, end) / 1e3) / 1e9


def _host_gbps(host: np.ndarray, repeats: int) -> float:
    segmented_checksum(host)
    t0 = time.perf_counter()
    for _ in range(repeats):
        segmented_checksum(host)
    return host.nbytes * repeats / (time.perf_counter() - t0) / 1e9


__all__ = ["SOURCE", "check_device_checksum", "device_checkable", "device_checksum", "device_digests",
           "key_table", "launch_shape"]
