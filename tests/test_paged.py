"""kvstore.paged: page gather/scatter over every physical layout, as raw bytes."""

import math

import numpy as np
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


# -- every layout against a page-by-page reference ----------------------------------------

KINDS = [*ORDERS, "separate", "typed"]
DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])   # gpu_check runs this suite on a GPU


def caches_of(kind, *, pages_per_block=1, dtype=torch.float16, seed=0, device="cpu"):
    """Per-layer caches of ``kind`` on ``device``: one of the vLLM orders over one buffer,
    separate tensors per layer (one op per layer), or sliced ones (the typed fallback)."""
    torch.manual_seed(seed)
    pages_n = B * pages_per_block
    if kind == "separate":
        return [torch.randn(pages_n, H, N, C).to(dtype).to(device) for _ in range(L)]
    if kind == "typed":      # the last dim sliced: a page is not whole runs of its storage
        return [torch.randn(pages_n, H, N, C + 1).to(dtype).to(device)[..., :C] for _ in range(L)]
    order = ORDERS[kind]
    logical = (L, pages_n, H, N, C)
    buf = torch.randn(math.prod(logical)).to(dtype).to(device)
    view = buf.view([logical[i] for i in order]).permute([order.index(i) for i in range(5)])
    return [view[layer] for layer in range(L)]


def page_bytes(cache, page):
    """One page's bytes in memory order (its dims sorted by stride), as a numpy array."""
    p = cache[page]
    order = sorted(range(p.dim()), key=lambda i: p.stride(i), reverse=True)
    return p.permute(order).contiguous().view(-1).view(torch.uint8).cpu().numpy().copy()


def expected_chunks(caches, ids, ppb):
    """The chunk buffer a gather of ``ids`` must produce: [chunk][layer][block][page]."""
    parts = [page_bytes(c, b * ppb + r) for row in ids.tolist() for c in caches for b in row for r in range(ppb)]
    return np.concatenate(parts)


def all_pages(caches):
    return [np.stack([page_bytes(c, p) for p in range(c.shape[0])]) for c in caches]


IDS = torch.tensor([[3, 1, 8], [7, 0, 11], [2, 10, 5]])            # 3 chunks of 3 blocks
KEEP = torch.tensor([[False, True, True], [True, False, True], [True, True, False]])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ppb", [1, 2])
@pytest.mark.parametrize("how", ["whole", "layers"])
def test_gather_gives_every_page_in_memory_order(kind, ppb, how, device):
    caches = caches_of(kind, pages_per_block=ppb, device=device)
    p = PagedLayers(caches, blocks_per_chunk=3, pages_per_block=ppb)
    out = torch.full((3 * p.chunk_bytes,), 0x5A, dtype=torch.uint8, device=device)
    if how == "whole":
        p.gather(IDS, out)
    else:
        for layer in (2, 0, 1):
            p.gather_layer(layer, IDS, out)
    assert (out.cpu().numpy() == expected_chunks(caches, IDS, ppb)).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ppb", [1, 2])
@pytest.mark.parametrize("how", ["whole", "layers"])
@pytest.mark.parametrize("masked", [False, True])
def test_scatter_writes_exactly_the_kept_pages(kind, ppb, how, masked, device):
    src_caches = caches_of(kind, pages_per_block=ppb, seed=1)
    chunks = torch.from_numpy(expected_chunks(src_caches, IDS, ppb)).to(device)
    caches = caches_of(kind, pages_per_block=ppb, seed=2, device=device)
    before = all_pages(caches)
    p = PagedLayers(caches, blocks_per_chunk=3, pages_per_block=ppb)
    keep = KEEP if masked else None
    if how == "whole":
        p.scatter(IDS, chunks, keep=keep)
    else:
        for layer in range(L):
            p.scatter_layer(layer, IDS, chunks, keep=keep)
    after = all_pages(caches)
    want = [b.copy() for b in before]
    for c, row in enumerate(IDS.tolist()):
        for j, block in enumerate(row):
            if masked and not KEEP[c, j]:
                continue
            for r in range(ppb):
                for layer, src in enumerate(src_caches):
                    want[layer][block * ppb + r] = page_bytes(src, row[j] * ppb + r)
    for got, exp in zip(after, want):
        assert (got == exp).all()
    if masked:          # the masked-out blocks really kept their bytes
        assert not (after[0][3 * ppb] == page_bytes(src_caches[0], 3 * ppb)).all()


@pytest.mark.parametrize("kind", ["LBHNC", "separate", "typed"])
def test_a_keep_mask_of_all_true_is_no_mask_and_all_false_writes_nothing(kind):
    src = caches_of(kind, seed=1)
    chunks = torch.from_numpy(expected_chunks(src, IDS, 1))
    a, b = caches_of(kind, seed=2), caches_of(kind, seed=2)
    PagedLayers(a, blocks_per_chunk=3).scatter(IDS, chunks, keep=torch.ones(3, 3, dtype=torch.bool))
    PagedLayers(b, blocks_per_chunk=3).scatter(IDS, chunks)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = caches_of(kind, seed=2)
    before = all_pages(c)
    q = PagedLayers(c, blocks_per_chunk=3)
    q.scatter(IDS, chunks, keep=torch.zeros(3, 3, dtype=torch.bool))
    q.scatter_layer(1, IDS, chunks, keep=torch.zeros(3, 3, dtype=torch.bool))
    assert all((x == y).all() for x, y in zip(all_pages(c), before))


def test_many_chunks_and_other_dtypes_round_trip():
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        for kind in ("LHBNC", "typed"):
            src = caches_of(kind, dtype=dtype, seed=3) if dtype != torch.int8 else \
                [torch.randint(-128, 127, (B, H, N, C), dtype=torch.int8) for _ in range(L)]
            p = PagedLayers(src, blocks_per_chunk=1)
            ids = torch.randperm(B).view(B, 1)
            out = torch.empty(B * p.chunk_bytes, dtype=torch.uint8)
            for layer in range(L):
                p.gather_layer(layer, ids, out)
            dst = [torch.zeros_like(c) for c in src]
            q = PagedLayers(dst, blocks_per_chunk=1)
            for layer in range(L):
                q.scatter_layer(layer, ids, out)
            assert all(torch.equal(x, y) for x, y in zip(src, dst))


# -- bounds and argument checks, before anything moves ----------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["LBHNC", "LHBNC", "separate", "typed"])
@pytest.mark.parametrize("ppb", [1, 2])
def test_bad_block_ids_raise_on_every_call_and_move_nothing(kind, ppb, device):
    caches = caches_of(kind, pages_per_block=ppb, device=device)
    before = all_pages(caches)
    p = PagedLayers(caches, blocks_per_chunk=2, pages_per_block=ppb)
    assert p.num_blocks == B
    out = torch.full((p.chunk_bytes,), 7, dtype=torch.uint8, device=device)
    calls = [lambda ids: p.gather(ids, out), lambda ids: p.scatter(ids, out),
             lambda ids: p.scatter(ids, out, keep=torch.tensor([[True, False]])),
             lambda ids: p.gather_layer(1, ids, out), lambda ids: p.scatter_layer(1, ids, out),
             lambda ids: p.scatter_layer(0, ids, out, keep=torch.tensor([[False, True]]))]
    for bad in ([[0, B]], [[-1, 2]], [[B * ppb, 0]]):
        for call in calls:
            with pytest.raises(InvalidArgumentError, match=rf"\[0, {B}\)"):
                call(torch.tensor(bad))
    assert all((x == y).all() for x, y in zip(all_pages(caches), before))
    assert bool((out == 7).all())


def test_bad_arguments_name_what_is_wrong():
    p = PagedLayers(caches_of("LBHNC"), blocks_per_chunk=2)
    buf = torch.empty(p.chunk_bytes, dtype=torch.uint8)
    ids = torch.tensor([[0, 1]])
    with pytest.raises(InvalidArgumentError, match="blocks_per_chunk|\\[n_chunks, 2\\]"):
        p.gather(torch.tensor([0, 1]), buf)                        # 1-d
    with pytest.raises(InvalidArgumentError, match=r"\[n_chunks, 2\]"):
        p.gather_layer(0, torch.tensor([[0, 1, 2]]), torch.empty(p.chunk_bytes * 3 // 2, dtype=torch.uint8))
    with pytest.raises(InvalidArgumentError, match="integers"):
        p.gather(ids.float(), buf)
    with pytest.raises(InvalidArgumentError, match="layer 3 out of range"):
        p.gather_layer(L, ids, buf)
    with pytest.raises(InvalidArgumentError, match="layer -1 out of range"):
        p.scatter_layer(-1, ids, buf)
    with pytest.raises(InvalidArgumentError, match="does not match"):
        p.scatter(ids, buf, keep=torch.tensor([True, False]))
    with pytest.raises(BufferSizeError):
        p.gather_layer(0, ids, torch.empty(p.chunk_bytes + 1, dtype=torch.uint8))
    with pytest.raises(BufferSizeError):
        p.scatter_layer(0, ids, torch.empty(p.chunk_bytes - 2, dtype=torch.uint8), keep=torch.tensor([[True, False]]))
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        p.gather_layer(0, ids, torch.empty(2 * p.chunk_bytes, dtype=torch.uint8)[::2])
    with pytest.raises(InvalidArgumentError, match="aligned"):
        p.gather_layer(1, ids, torch.empty(p.chunk_bytes + 1, dtype=torch.uint8)[1:])


def test_a_keep_mask_on_a_device_is_refused():
    caches = [torch.empty(B, H, N, C, dtype=torch.float16, device="meta") for _ in range(L)]
    p = PagedLayers(caches, blocks_per_chunk=2)
    buf = torch.empty(p.chunk_bytes, dtype=torch.uint8, device="meta")
    keep = torch.tensor([[True, False]], device="meta")
    for call in (lambda: p.scatter(torch.tensor([[0, 1]]), buf, keep=keep),
                 lambda: p.scatter_layer(0, torch.tensor([[0, 1]]), buf, keep=keep)):
        with pytest.raises(InvalidArgumentError, match="keep masks must be host tensors"):
            call()


# -- the device side: one op per layer, nothing read back ----------------------------------
# The caches live on torch's "meta" device: ops run there without data, and anything that
# would read device memory back (nonzero(), .item(), bool()) raises. Each call's ops on
# the device are recorded: the same for 1 chunk as for 6.

SYNCING = {"nonzero", "_local_scalar_dense", "item", "is_nonzero", "masked_select", "equal", "_assert_async"}


def record_device_ops(fn):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    ops, uploads = [], []

    class Rec(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            name = func.overloadpacket.__name__
            if name == "_to_copy" and str(kwargs.get("device", "")) == "meta":
                uploads.append(tensors[0].numel())
            elif any(t.device.type == "meta" for t in tensors) and not func.is_view and \
                    name not in ("empty", "as_strided", "_reshape_alias", "alias", "detach", "lift_fresh"):
                ops.append(name)
            return func(*args, **kwargs)

    with Rec():
        fn()
    return ops, uploads


def meta_caches(kind, ppb):
    if kind == "separate":
        return [torch.empty(B * ppb, H, N, C, dtype=torch.float16, device="meta") for _ in range(L)]
    if kind == "typed":
        return [torch.empty(B * ppb, H, N, C + 1, dtype=torch.float16, device="meta")[..., :C] for _ in range(L)]
    order = ORDERS[kind]
    logical = (L, B * ppb, H, N, C)
    buf = torch.empty(L * B * ppb * H * N * C, dtype=torch.float16, device="meta")
    view = buf.view([logical[i] for i in order]).permute([order.index(i) for i in range(5)])
    return [view[layer] for layer in range(L)]


@pytest.mark.parametrize("kind", ["LBHNC", "LHBNC", "BHLNC", "separate", "typed"])
@pytest.mark.parametrize("ppb", [1, 2])
def test_one_device_op_per_layer_whatever_the_chunk_count(kind, ppb):
    p = PagedLayers(meta_caches(kind, ppb), blocks_per_chunk=2, pages_per_block=ppb)
    layered_op = not p.single_op
    seen = {}
    for n in (1, 6):
        ids = torch.randperm(B)[: 2 * n].view(n, 2)           # host ids, as the connectors pass
        keep = torch.ones(n, 2, dtype=torch.bool)
        keep[0, 0] = False                                    # host mask
        buf = torch.empty(n * p.chunk_bytes, dtype=torch.uint8, device="meta")
        calls = {"gather": lambda: p.gather(ids, buf), "scatter": lambda: p.scatter(ids, buf),
                 "scatter keep": lambda: p.scatter(ids, buf, keep=keep),
                 "gather_layer": lambda: p.gather_layer(1, ids, buf),
                 "scatter_layer": lambda: p.scatter_layer(1, ids, buf),
                 "scatter_layer keep": lambda: p.scatter_layer(1, ids, buf, keep=keep)}
        for name, call in calls.items():
            ops, uploads = record_device_ops(call)
            assert not SYNCING & set(ops), (name, ops)
            assert len(uploads) == 1, (name, uploads)          # one host->device copy per call
            seen.setdefault(name, []).append(ops)
    for name, (one, six) in seen.items():
        assert one == six, (name, one, six)                     # no op per chunk
    per_layer = L if layered_op else 1
    assert seen["gather"][0] == (["index"] * L if layered_op else ["index_select"])
    assert seen["scatter"][0] == (["index_put_"] * L if layered_op else ["index_copy_"])
    assert seen["scatter keep"][0] == (["index", "index_put_"] * L if layered_op else ["index_select", "index_copy_"])
    assert len(seen["gather"][0]) == per_layer
    assert seen["gather_layer"][0] == ["index"]
    assert seen["scatter_layer"][0] == ["index_put_"]
    assert seen["scatter_layer keep"][0] == ["index", "index_put_"]


def test_ids_already_on_the_device_are_used_without_reading_them_back():
    p = PagedLayers(meta_caches("LHBNC", 2), blocks_per_chunk=2, pages_per_block=2)
    ids = torch.tensor([[0, 1], [4, 3]], device="meta")
    buf = torch.empty(2 * p.chunk_bytes, dtype=torch.uint8, device="meta")
    keep = torch.tensor([[True, False], [True, True]])
    for call in (lambda: p.gather(ids, buf), lambda: p.scatter(ids, buf, keep=keep),
                 lambda: p.gather_layer(0, ids, buf), lambda: p.scatter_layer(1, ids, buf, keep=keep)):
        ops, _ = record_device_ops(call)
        assert not SYNCING & set(ops), ops


def test_cpu_caches_never_touch_pinned_memory(monkeypatch):
    def no_pinning(self, *a, **k):
        raise AssertionError("pin_memory called for a CPU cache")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinning)
    for kind in ("LBHNC", "separate", "typed"):
        src = caches_of(kind)
        p = PagedLayers(src, blocks_per_chunk=3)
        out = torch.empty(3 * p.chunk_bytes, dtype=torch.uint8)
        p.gather(IDS, out)
        p.scatter(IDS, out, keep=KEEP)
        p.gather_layer(0, IDS, out)
        p.scatter_layer(0, IDS, out, keep=KEEP)
        gather_pages(src[0], 0, IDS.reshape(-1), out[: 9 * page_bytes_of(src[0])])


def test_host_ids_reach_a_cuda_device_in_one_copy_from_pinned_memory(monkeypatch):
    from kvstore import paged

    copies = []

    def pin(self, *a, **k):
        t = self.clone()
        t.pinned_marker = True
        return t

    def to(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            copies.append((getattr(self, "pinned_marker", False), kwargs.get("non_blocking", False), self.numel()))
            return self
        return real_to(self, *args, **kwargs)

    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    a, b = torch.arange(6).view(2, 3), torch.arange(4)
    out = paged._upload([a, b, a], torch.device("cuda", 0))
    assert copies == [(True, True, 10)]                    # once, pinned, non-blocking; `a` once
    assert torch.equal(out[0], a) and torch.equal(out[1], b) and out[2] is out[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (sync debug mode)")
@pytest.mark.parametrize("kind", ["LBHNC", "LHBNC", "separate", "typed"])
def test_no_host_sync_on_a_cuda_cache(kind):
    caches = caches_of(kind, pages_per_block=2, device="cuda:0")
    p = PagedLayers(caches, blocks_per_chunk=3, pages_per_block=2)
    out = torch.empty(3 * p.chunk_bytes, dtype=torch.uint8, device="cuda:0")
    src = torch.from_numpy(expected_chunks(caches, IDS, 2)).to("cuda:0")
    one = torch.empty(4 * page_bytes_of(caches[0]), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        p.gather(IDS, out)
        p.scatter(IDS, src, keep=KEEP)
        for layer in range(L):
            p.gather_layer(layer, IDS, out)
            p.scatter_layer(layer, IDS, src, keep=KEEP)
            p.scatter_layer(layer, IDS, src)
        gather_pages(caches[0], 0, IDS.reshape(-1)[:4], one)
        scatter_pages(caches[0], 0, IDS.reshape(-1)[:4], one)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(out, src)
