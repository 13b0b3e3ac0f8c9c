"""The client's batched copies: coalescing adjacent ranges and splitting over threads
must copy exactly the same bytes as one copy per block."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvstore._copy import coalesce, copy_batch
from kvstore.errors import BufferSizeError


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("layout", ["contiguous", "scattered", "mixed"])
def test_copy_batch_matches_per_block_copies(threads, layout):
    rng = np.random.default_rng(1)
    block, n = 1 << 20, 12
    src = rng.integers(0, 256, (n + 4) * block, dtype=np.uint8)
    dst = np.zeros((n + 4) * block, np.uint8)
    if layout == "contiguous":
        order = list(range(n))
    elif layout == "scattered":
        order = list(rng.permutation(n + 4)[:n])
    else:
        order = [0, 1, 2, 5, 6, 9, 3, 4, 10, 11, 12, 15]
    pairs = [(dst[i * block:(i + 1) * block], src[j * block:(j + 1) * block]) for i, j in zip(range(n), order)]
    pairs.append((bytearray(100), memoryview(src)[:100]))  # a non-numpy buffer joins too
    with ThreadPoolExecutor(2) as pool:
        copy_batch(pairs, n * block + 100, pool, threads)
    for d, s in pairs:
        assert np.array_equal(np.frombuffer(d, np.uint8), np.frombuffer(s, np.uint8))
    assert not dst[n * block:].any()  # nothing written past the destinations
    if layout == "contiguous":
        assert len(coalesce(pairs[:-1])) == 1


def test_size_mismatch_raises():
    with pytest.raises(BufferSizeError):
        copy_batch([(np.zeros(4, np.uint8), np.zeros(5, np.uint8))], 5, None, 1)
