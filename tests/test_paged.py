"""kvstore.paged: page gather/scatter over every physical layout, as raw bytes."""

import pytest
import torch

from kvstore.errors import BufferSizeError, InvalidArgumentError
from kvstore.paged import PagedLayers, gather_pages, page_bytes_of, scatter_pages

L, B, H, N, C = 3, 12, 2, 4, 8
# Stride orders of the logical [L, B, H, N, C] cache (vLLM's KVCacheLayout values).
ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
          "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def layered(order, *, pages_per_block=1, fill=True, dtype=torch.float16):
    """Per-layer [pages, H, N, C] views over one buffer in the given physical order."""
    logical = (L, B * pages_per_block, H, N, C)
    phys = [logical[i] for i in order]
    numel = L * B * pages_per_block * H * N * C
    buf = torch.randn(numel).to(dtype) if fill else torch.zeros(numel, dtype=dtype)
    inv = [order.index(i) for i in range(5)]
    view = buf.view(phys).permute(inv)
    return buf, [view[layer] for layer in range(L)]


def pages(caches, blocks, ppb=1):
    rows = torch.tensor([b * ppb + r for b in blocks for r in range(ppb)])
    return [c[rows] for c in caches]


@pytest.mark.parametrize("name", list(ORDERS))
@pytest.mark.parametrize("ppb", [1, 2])
def test_round_trip_to_other_blocks(name, ppb):
    _, src = layered(ORDERS[name], pages_per_block=ppb)
    _, dst = layered(ORDERS[name], pages_per_block=ppb, fill=False)
    a = PagedLayers(src, blocks_per_chunk=2, pages_per_block=ppb)
    b = PagedLayers(dst, blocks_per_chunk=2, pages_per_block=ppb)
    assert a.chunk_bytes == L * 2 * ppb * H * N * C * 2
    buf = torch.empty(2 * a.chunk_bytes, dtype=torch.uint8)
    a.gather(torch.tensor([[3, 1], [7, 0]]), buf)
    b.scatter(torch.tensor([[2, 5], [9, 4]]), buf)
    for x, y in zip(pages(src, [3, 1, 7, 0], ppb), pages(dst, [2, 5, 9, 4], ppb)):
        assert torch.equal(x, y)
    untouched = [i for i in range(B) if i not in (2, 5, 9, 4)]
    assert all(bool((p == 0).all()) for p in pages(dst, untouched, ppb))


@pytest.mark.parametrize("name", ["LBHNC", "LHBNC", "BLNHC"])
def test_layerwise_equals_whole(name):
    _, src = layered(ORDERS[name])
    p = PagedLayers(src, blocks_per_chunk=3)
    ids = torch.tensor([[0, 4, 8], [11, 1, 2]])
    whole = torch.empty(2 * p.chunk_bytes, dtype=torch.uint8)
    split = torch.full_like(whole, 7)
    p.gather(ids, whole)
    for layer in reversed(range(L)):
        p.gather_layer(layer, ids, split)
    assert torch.equal(whole, split)
    buf1, dst1 = layered(ORDERS[name], fill=False)
    buf2, dst2 = layered(ORDERS[name], fill=False)
    PagedLayers(dst1, blocks_per_chunk=3).scatter(ids, whole)
    q = PagedLayers(dst2, blocks_per_chunk=3)
    for layer in range(L):
        q.scatter_layer(layer, ids, whole)
    assert torch.equal(buf1, buf2)


@pytest.mark.parametrize("name", ["LBHNC", "LHBNC"])
def test_keep_mask_leaves_blocks_untouched(name):
    _, src = layered(ORDERS[name])
    p = PagedLayers(src, blocks_per_chunk=2)
    buf = torch.empty(2 * p.chunk_bytes, dtype=torch.uint8)
    p.gather(torch.tensor([[0, 1], [2, 3]]), buf)
    _, dst = layered(ORDERS[name], fill=False)
    keep = torch.tensor([[False, True], [True, False]])
    PagedLayers(dst, blocks_per_chunk=2).scatter(torch.tensor([[4, 5], [6, 7]]), buf, keep=keep)
    for x, y in zip(pages(src, [1, 2]), pages(dst, [5, 6])):
        assert torch.equal(x, y)
    assert all(bool((q == 0).all()) for q in pages(dst, [4, 7]))


@pytest.mark.parametrize("name", list(ORDERS))
def test_layers_of_one_allocation_move_in_one_op(name):
    _, caches = layered(ORDERS[name])
    assert PagedLayers(caches, blocks_per_chunk=1).single_op
    separate = [torch.zeros(B, H, N, C) for _ in range(2)]
    assert not PagedLayers(separate, blocks_per_chunk=1).single_op


def test_unaligned_cache_falls_back_to_typed_ops():
    base = torch.randn(1 + B * H * N * C)
    cache = base[1:].view(B, H, N, C)[:, :, :, : C - 1]   # page rows are not whole runs
    other = torch.zeros_like(cache)
    out = torch.empty(3 * page_bytes_of(cache), dtype=torch.uint8)
    gather_pages(cache, 0, torch.tensor([4, 2, 0]), out)
    scatter_pages(other, 0, torch.tensor([0, 1, 2]), out)
    assert torch.equal(other[:3], cache[[4, 2, 0]])


def test_single_tensor_helpers_and_page_dim():
    cache = torch.randn(2, B, N, H, C)            # older vLLM: (K/V, blocks, ...)
    assert page_bytes_of(cache, 1) == 2 * N * H * C * 4   # K and V halves: two runs a page
    ids = torch.tensor([5, 0, 9])
    out = torch.empty(3 * page_bytes_of(cache, 1), dtype=torch.uint8)
    gather_pages(cache, 1, ids, out)
    other = torch.zeros_like(cache)
    scatter_pages(other, 1, torch.tensor([1, 2, 3]), out)
    assert torch.equal(other[:, 1:4], cache[:, [5, 0, 9]])


def test_bad_buffers_and_ids_raise():
    _, src = layered(ORDERS["LBHNC"])
    p = PagedLayers(src, blocks_per_chunk=2)
    with pytest.raises(BufferSizeError):
        p.gather(torch.tensor([[0, 1]]), torch.empty(p.chunk_bytes - 1, dtype=torch.uint8))
    with pytest.raises(InvalidArgumentError):
        p.gather(torch.tensor([[0, B]]), torch.empty(p.chunk_bytes, dtype=torch.uint8))
    with pytest.raises(InvalidArgumentError):
        p.scatter(torch.tensor([[0, 1]]), torch.empty(2 * p.chunk_bytes, dtype=torch.uint8)[::2])
    with pytest.raises(InvalidArgumentError):
        PagedLayers([], blocks_per_chunk=1)


def test_page_ids_are_checked_on_the_host_before_they_reach_the_device():
    cache = torch.arange(10 * 64, dtype=torch.float32).view(10, 64)
    out = torch.empty(2 * 64 * 4, dtype=torch.uint8)
    for bad in ([0, 10], [-1, 2]):
        with pytest.raises(InvalidArgumentError, match=r"\[0, 10\)"):
            gather_pages(cache, 0, torch.tensor(bad), out)
        with pytest.raises(InvalidArgumentError, match=r"\[0, 10\)"):
            scatter_pages(cache, 0, torch.tensor(bad), out)
    assert torch.equal(cache, torch.arange(10 * 64, dtype=torch.float32).view(10, 64))   # untouched
