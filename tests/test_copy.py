"""The client's batched copies: coalescing adjacent ranges and splitting over threads
must copy exactly the same bytes as one copy per block, both into a region and out."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvstore.buffers.host import copy_batch, plan
from kvstore.errors import BufferSizeError, InvalidArgumentError

BLOCK, N = 1 << 20, 12


def _layout(name: str, rng: np.random.Generator) -> list[int]:
    if name == "contiguous":
        return list(range(N))
    if name == "scattered":
        return [int(j) for j in rng.permutation(N + 4)[:N]]
    return [0, 1, 2, 5, 6, 9, 3, 4, 10, 11, 12, 15]


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("layout", ["contiguous", "scattered", "mixed"])
def test_copy_out_of_region_matches_per_block_copies(threads, layout):
    rng = np.random.default_rng(1)
    region = rng.integers(0, 256, (N + 4) * BLOCK + 100, dtype=np.uint8)
    dst = np.zeros((N + 4) * BLOCK, np.uint8)
    order = _layout(layout, rng)
    bufs = [dst[i * BLOCK:(i + 1) * BLOCK] for i in range(N)] + [bytearray(100)]  # a non-numpy buffer too
    offsets = [j * BLOCK for j in order] + [(N + 4) * BLOCK]
    sizes = [BLOCK] * N + [100]
    with ThreadPoolExecutor(2) as pool:
        copy_batch(bufs, sizes, region, region.ctypes.data, offsets, False, pool, threads)
    for buf, off, n in zip(bufs, offsets, sizes):
        assert np.array_equal(np.frombuffer(buf, np.uint8), region[off:off + n])
    assert not dst[N * BLOCK:].any()  # nothing written past the destinations
    if layout == "contiguous":
        runs, device = plan(bufs[:-1], sizes[:-1], region.ctypes.data, offsets[:-1], True)
        assert len(runs) == 1 and runs[0][2] == N * BLOCK and not device


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("layout", ["contiguous", "scattered"])
def test_copy_into_region_matches_per_block_copies(threads, layout):
    rng = np.random.default_rng(2)
    src = rng.integers(0, 256, (N, BLOCK), dtype=np.uint8)
    region = np.zeros((N + 4) * BLOCK, np.uint8)
    offsets = [j * BLOCK for j in _layout(layout, rng)]
    with ThreadPoolExecutor(2) as pool:
        copy_batch(list(src), [BLOCK] * N, region, region.ctypes.data, offsets, True, pool, threads)
    written = np.zeros(len(region), bool)
    for row, off in zip(src, offsets):
        assert np.array_equal(region[off:off + BLOCK], row)
        written[off:off + BLOCK] = True
    assert not region[~written].any()  # nothing written outside the blocks' ranges


def test_size_mismatch_raises_before_copying():
    region = np.ones(8, np.uint8)
    dst = np.zeros(4, np.uint8)
    with pytest.raises(BufferSizeError):
        copy_batch([dst], [5], region, region.ctypes.data, [0], False, None, 1)
    assert not dst.any()


def test_read_only_destination_is_refused():
    region = np.ones(8, np.uint8)
    dst = np.zeros(8, np.uint8)
    dst.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="read-only"):
        copy_batch([dst], [8], region, region.ctypes.data, [0], False, None, 1)
    assert not dst.any()


def test_device_buffers_move_in_one_batch_from_a_mapping_pinned_on_first_use(monkeypatch):
    """The same-host client path: device buffers go to or from the mapped region as one
    copier batch (not one synchronous copy per block), straight from the mapping, which is
    registered with CUDA on the first batch that has device buffers, never before. The
    device is torch's "meta" device and the copier a recorder (no GPU here)."""
    import torch

    from kvstore.buffers import host as _copy

    class Pin:
        ensured = 0

        def ensure(self):
            Pin.ensured += 1
            return True

    batches = []
    monkeypatch.setattr(_copy, "copy_device_pairs", lambda pairs, pinned=False: batches.append((pairs, pinned)))
    region = np.zeros(8 * BLOCK, np.uint8)
    pin = Pin()
    host = [np.full(BLOCK, 7, np.uint8)]
    copy_batch(host, [BLOCK], region, region.ctypes.data, [0], True, None, 1, pin)
    assert Pin.ensured == 0 and batches == [] and (region[:BLOCK] == 7).all()     # no device copy: no pin
    dev = [torch.empty(BLOCK, dtype=torch.uint8, device="meta") for _ in range(3)]
    copy_batch([dev[0], host[0], dev[1], dev[2]], [BLOCK] * 4, region, region.ctypes.data,
               [BLOCK * i for i in (1, 2, 3, 5)], True, None, 1, pin)
    assert Pin.ensured == 1 and len(batches) == 1
    pairs, pinned = batches[0]
    assert pinned and [src for _, src in pairs] == dev                       # one batch, every device block
    assert [dst.ctypes.data - region.ctypes.data for dst, _ in pairs] == [BLOCK, 3 * BLOCK, 5 * BLOCK]
    assert (region[2 * BLOCK:3 * BLOCK] == 7).all()
