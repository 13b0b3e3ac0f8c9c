"""The segmented payload checksum: the C-backed host path, the numpy reference written
from the XXH3 specification, and the CUDA kernel's source compiled for the host."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import xxhash

from kvstore._segsum import SEGMENT_BYTES, combine, segment_digests, segment_spans, segmented_checksum
from kvstore._segsum_cuda import KEY_LAST, KEY_MERGE, KEY_SCRAMBLE, KEY_STRIPE, SOURCE, key_table, launch_shape
from kvstore._segsum_ref import reference_checksum, reference_digests, xxh3_64

S = SEGMENT_BYTES
EDGE_SIZES = [0, 1, 3, 4, 8, 9, 16, 17, 100, 128, 129, 200, 240, 241, 1000, 1023, 1024, 1025, 4097,
              S - 1, S, S + 1, 2 * S - 1, 2 * S, 2 * S + 1, 2 * S + 3, 3 * S + 31, 5 * S + 1000,
              31 * S + 7, 32 * S, 33 * S - 5, (4 << 20) + 5]


def payload(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8)


def test_reference_xxh3_matches_the_c_library_on_every_path():
    for n in list(range(0, 260)) + [1023, 1024, 1025, 2048, 3000]:
        data = payload(n)
        assert xxh3_64(data) == xxhash.xxh3_64_intdigest(data.tobytes()), n


@pytest.mark.parametrize("n", EDGE_SIZES)
def test_reference_matches_host_path(n):
    data = payload(n)
    assert reference_checksum(data) == segmented_checksum(data)
    assert reference_digests(data) == list(segment_digests(data))
    assert combine(segment_digests(data)) == segmented_checksum(data)


def test_host_path_on_random_payloads_and_buffer_kinds():
    rng = np.random.default_rng(7)
    for n in rng.integers(0, 6 * S, 12):
        data = payload(int(n), seed=1)
        want = reference_checksum(data)
        assert segmented_checksum(data) == want
        assert segmented_checksum(bytearray(data.tobytes())) == want
        assert segmented_checksum(memoryview(data.tobytes())) == want


def test_segments_cover_the_payload_once():
    for n in EDGE_SIZES:
        spans = segment_spans(n)
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        if len(spans) > 1:
            assert all(S <= end - start < 2 * S for start, end in spans)


def test_one_segment_is_plain_xxh3_and_more_are_not():
    small, large = payload(2 * S - 1), payload(2 * S)
    assert segmented_checksum(small) == xxhash.xxh3_64_intdigest(small)
    assert segmented_checksum(large) != xxhash.xxh3_64_intdigest(large)


def test_a_flipped_byte_changes_the_checksum_in_every_segment():
    data = payload(5 * S + 17)
    want = segmented_checksum(data)
    for at in (0, S - 1, S, 3 * S + 5, data.nbytes - 1):
        data[at] ^= 0x40
        assert segmented_checksum(data) != want
        data[at] ^= 0x40


# -- the kernel's source, built for the host ----------------------------------------------

_HOST_SHIM = r"""
#define __device__
#define __global__
#define __forceinline__ inline
struct Dim { unsigned x; };
static Dim threadIdx, blockIdx, blockDim;
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
"""

_HOST_LAUNCH = r"""
typedef unsigned long long u64;
extern "C" void run(const unsigned char* data, u64 n, u64 seg, u64 nseg, u64 max_blocks, const u64* keys,
                    u64* partial, u64* out) {
    blockDim.x = 64;
    u64 threads = nseg * max_blocks * 8;
    for (blockIdx.x = 0; blockIdx.x < (threads + 63) / 64; ++blockIdx.x)     /* every thread of launch 1, */
        for (threadIdx.x = 0; threadIdx.x < 64; ++threadIdx.x)                /* then every one of launch 2 */
            segsum_blocks(data, n, seg, nseg, max_blocks, keys, partial);
    for (blockIdx.x = 0; blockIdx.x < (nseg + 63) / 64; ++blockIdx.x)
        for (threadIdx.x = 0; threadIdx.x < 64; ++threadIdx.x)
            segsum_finish(data, n, seg, nseg, max_blocks, keys, partial, out);
}
"""

_DEFINES = (f"#define KEY_STRIPE {KEY_STRIPE}\n#define KEY_SCRAMBLE {KEY_SCRAMBLE}\n"
            f"#define KEY_LAST {KEY_LAST}\n#define KEY_MERGE {KEY_MERGE}\n")


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the kernel source for the host")
    d = tmp_path_factory.mktemp("segsum")
    src, lib = d / "kernel.cpp", d / "kernel.so"
    src.write_text(_HOST_SHIM + _DEFINES + SOURCE + _HOST_LAUNCH)
    subprocess.run([cxx, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    run = ctypes.CDLL(str(lib)).run
    run.restype = None
    keys = key_table()

    def digests(data: np.ndarray) -> list[int]:
        nseg, max_blocks = launch_shape(data.nbytes)
        partial = np.zeros(nseg * max_blocks * 8, dtype=np.uint64)
        out = np.zeros(nseg, dtype=np.uint64)
        u64 = ctypes.c_ulonglong
        run(ctypes.c_void_p(data.ctypes.data), u64(data.nbytes), u64(S), u64(nseg), u64(max_blocks),
            ctypes.c_void_p(keys.ctypes.data), ctypes.c_void_p(partial.ctypes.data), ctypes.c_void_p(out.ctypes.data))
        return out.tolist()

    return digests


@pytest.mark.parametrize("n", [n for n in EDGE_SIZES if n >= 241])
def test_kernel_source_matches_the_host_path(host_kernel, n):
    data = payload(n, seed=3)
    assert host_kernel(data) == list(segment_digests(data))
    assert combine(host_kernel(data)) == segmented_checksum(data)


def test_kernel_source_reads_the_final_stripe_at_any_alignment(host_kernel):
    base = payload(3 * S + 64, seed=4)
    for n in (3 * S + 1, 3 * S + 3, 3 * S + 9, 3 * S + 63):
        data = base[:n].copy()
        assert combine(host_kernel(data)) == reference_checksum(data)


def test_kernel_source_compiles_for_cuda():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    proc = subprocess.run([nvcc, "--ptx", "-x", "cu", "-o", "/dev/null", "-"], input=(_DEFINES + SOURCE).encode(),
                          capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()


def test_device_check_reports_instead_of_raising_without_cuda():
    from kvstore._segsum_cuda import check_device_checksum

    try:
        import cupy
        available = cupy.is_available()
    except Exception:
        available = False
    if available:
        pytest.skip("a CUDA device is present: benchmarks/gpu_check.py runs the real check")
    result = check_device_checksum(sizes=(1000,), repeats=1)
    assert result["ok"] is False and result["error"] and result["rows"] == []
