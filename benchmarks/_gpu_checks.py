"""Correctness checks of the GPU data path for ``benchmarks/gpu_check.py``: each one is
small and self-contained, takes the run's :class:`Context`, and returns rows; the
driver turns an exception into a failed row. Without CUDA, the stream-order check is
skipped and the others run on host tensors (their CUDA parts — pinning, kvikio, sync
debug mode — are then not exercised, and their notes say so), so CPU machines still
run their logic.

- stream order: a producer on a side stream, delayed with ``torch.cuda._sleep``, is
  still writing when Store.save is called, and a consumer of the old contents is still
  pending when Store.load is called; the bytes must come out exact;
- stale pinning: a DRAM tier opened, used from the device, closed and reopened at the
  same size (the arena often lands at the same address) is pinned again and loads exact;
- a corrupted payload byte on disk, read through the NVMe tier into device memory
  (kvikio where installed): a miss, counted, never ``True``;
- paged gather/scatter (whole chunks and layer by layer, with and without a keep mask,
  for one-allocation, per-layer and typed-fallback caches, and the single-tensor
  helpers): host syncs counted per call under ``torch.cuda.set_sync_debug_mode``
  (0 expected), and the bytes moved are right.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.keys import Namespace

SLEEP_CYCLES = 200_000_000      # ~0.1 s of a spinning kernel at 1.5-2 GHz


@dataclass(frozen=True)
class Context:
    dev: torch.device
    block: int                  # bytes per block in throughput rows
    n: int                      # blocks per batch in throughput rows
    rounds: int
    quick: bool
    workdir: str                # a private temporary directory for this run

    @property
    def cuda(self) -> bool:
        return self.dev.type == "cuda"


def verdict(check: str, dev: torch.device, ok: bool, note: str) -> dict:
    """A correctness row (no throughput)."""
    return {"check": check, "device": str(dev), "bytes_ok": bool(ok), "note": note}


def _keys(tag: str, n: int):
    return Namespace(model=f"gpu-check-{tag}", dtype="uint8", chunk_tokens=1).chunk_keys(np.arange(n))


def _patterns(dev: torch.device, n: int, nbytes: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(dev) for _ in range(n)]


def stream_order(ctx: Context) -> list[dict]:
    """Save and load with work still pending on the caller's (side) stream: the Store must
    order its copies after it. A control shows the delay makes an unordered copy race."""
    if not ctx.cuda or not hasattr(torch.cuda, "_sleep"):
        return [{"check": "stream order", "skipped": "needs CUDA (torch.cuda._sleep)"}]
    from kvstore.store import Store

    n, nbytes = 8, 1 << 20
    want = _patterns(ctx.dev, n, nbytes, seed=11)
    keys = _keys("order", n)
    side = torch.cuda.Stream(ctx.dev)

    probe_src = torch.zeros(nbytes, dtype=torch.uint8, device=ctx.dev)
    torch.cuda.synchronize(ctx.dev)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        probe_src.copy_(want[0])
    probe = probe_src.clone()                      # on the default stream: not ordered after side
    torch.cuda.synchronize(ctx.dev)
    race = not torch.equal(probe, want[0])

    rows = []
    for kind, tier in (("dram", {"name": "ram", "kind": "dram", "capacity": 4 * n * nbytes}),
                       ("gpu", {"name": "hbm", "kind": "gpu", "device": str(ctx.dev), "capacity": 4 * n * nbytes})):
        with Store.from_config({"tiers": [tier]}) as store:
            srcs = [torch.zeros(nbytes, dtype=torch.uint8, device=ctx.dev) for _ in range(n)]
            dsts = [torch.zeros(nbytes, dtype=torch.uint8, device=ctx.dev) for _ in range(n)]
            torch.cuda.synchronize(ctx.dev)
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP_CYCLES)
                for s, w in zip(srcs, want):
                    s.copy_(w)                     # the producer, still running at save time
                saved = store.save(keys, srcs)
            saved_ok = saved.result()
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP_CYCLES)
                for d in dsts:
                    d.fill_(0xAB)                  # queued before the load: must land first
                loaded = store.load(keys, dsts)
            loaded_ok = loaded.result()
            # read on the default stream right after result(): the documented contract
            exact = all(torch.equal(d, w) for d, w in zip(dsts, want))
        ok = all(saved_ok) and all(loaded_ok) and exact
        rows.append(verdict(f"stream order ({kind})", ctx.dev, ok,
                            f"save {sum(saved_ok)}/{n}, load {sum(loaded_ok)}/{n}, exact={exact}; unordered "
                            f"control copy {'raced (delay effective)' if race else 'did not race'}"))
    return rows


def stale_pinning(ctx: Context) -> list[dict]:
    """Open a DRAM tier, copy through it from the device, close; three times at one size.
    Each open must pin again (the last registration was undone at close) and load exact."""
    from kvstore.tiers.dram import DramTier

    n, nbytes = 8, 1 << 20
    keys = _keys("pin", n)
    addresses, pinned, exact = [], [], []
    for round_no in range(3):
        want = _patterns(ctx.dev, n, nbytes, seed=100 + round_no)   # new bytes each round
        tier = DramTier(4 * n * nbytes, name=f"gpu-check-pin-{round_no}")
        try:
            stored = tier.write(keys, want)
            dsts = [torch.zeros_like(w) for w in want]
            got = tier.read_into(keys, dsts)
            exact.append(all(stored) and all(got) and all(torch.equal(d, w) for d, w in zip(dsts, want)))
            pinned.append(bool(tier.stats()["pinned"]))
            addresses.append(tier.arena.ctypes.data)
        finally:
            tier.close()
    reused = len(set(addresses)) < len(addresses)
    ok = all(exact) and (all(pinned) or not ctx.cuda)
    return [verdict("reopen, stale pinning", ctx.dev, ok,
                    f"exact per open {exact}, pinned per open {pinned}"
                    f"{'' if ctx.cuda else ' (no CUDA: pinning not exercised)'}, "
                    f"arena address {'reused' if reused else 'not reused (check weaker)'}")]


def nvme_corrupt_payload(ctx: Context) -> list[dict]:
    """One payload byte flipped on disk, read into device memory through the NVMe tier:
    that block is a miss and counted, the others load exact. With and without the
    tier's on-device verification."""
    from kvstore.tiers.nvme import NvmeTier

    n, nbytes, bad = 4, 1 << 20, 2
    want = _patterns(ctx.dev, n, nbytes, seed=21)
    rows = []
    for device_verify in (False, True):
        path = os.path.join(ctx.workdir, f"nvme-corrupt-{int(device_verify)}")
        os.makedirs(path, exist_ok=True)
        keys = _keys(f"corrupt{int(device_verify)}", n)
        tier = NvmeTier(path, 64 << 20, name="gpu-check-nvme", file_bytes=16 << 20, io_threads=2,
                        device_verify=device_verify)
        try:
            stored = tier.write(keys, want)
            flipped = _flip_payload_byte(path, want[bad].cpu().numpy())
            dsts = [torch.zeros_like(w) for w in want]
            got = tier.read_into(keys, dsts)
            stats = tier.stats()
        finally:
            tier.close()
        good = [i for i in range(n) if i != bad]
        ok = (all(stored) and flipped and got[bad] is False and all(got[i] for i in good)
              and all(torch.equal(dsts[i], want[i]) for i in good) and stats["corrupt_blocks"] == 1)
        rows.append(verdict(f"NVMe corrupt byte -> miss (device_verify={device_verify})", ctx.dev, ok,
                            f"byte flipped={flipped}, results {got}, corrupt_blocks={stats['corrupt_blocks']}, "
                            f"gpu_io={stats.get('gpu_io')}, verified_on_device={stats.get('verified_on_device')}"))
    return rows


def _flip_payload_byte(directory: str, payload: np.ndarray) -> bool:
    """Find ``payload`` in the tier's data files (it is unique random bytes) and flip one
    byte in its middle, durably. Whether it was found."""
    needle = payload[:64].tobytes()
    for name in sorted(glob.glob(os.path.join(directory, "**", "*"), recursive=True)):
        if not os.path.isfile(name) or os.path.getsize(name) < payload.nbytes:
            continue
        with open(name, "r+b") as f:
            data = f.read()
            at = data.find(needle)
            if at < 0 or data[at:at + payload.nbytes] != payload.tobytes():
                continue
            pos = at + payload.nbytes // 2
            f.seek(pos)
            f.write(bytes([data[pos] ^ 0x01]))
            f.flush()
            os.fsync(f.fileno())
        return True
    return False


def _count_syncs(fn) -> int:
    """Host<->device synchronisations ``fn`` makes, as counted by torch's sync debug
    mode ("warn": one warning per synchronising call); then run once more under "error"
    so a sync the warning filter missed still fails."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    count = sum("synchroniz" in str(w.message) for w in caught)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError:
        count = max(count, 1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return count


def paged_sync_free(ctx: Context) -> list[dict]:
    """The connectors' hot path (host-side ids and keep masks, as the scheduler lists
    them) makes no host<->device synchronisation: every paged call — whole-chunk
    gather/scatter, layer-wise gather_layer/scatter_layer, with and without a keep mask,
    for caches in one allocation (one op for all layers), separate per-layer caches, and
    caches that need the typed fallback, and the single-tensor gather_pages /
    scatter_pages (SGLang) — is counted under torch's sync debug mode. The bytes each
    call moved are checked afterwards against plain indexing."""
    from kvstore.paged import PagedLayers, gather_pages, scatter_pages

    dev, layers_n, pages, per, n = ctx.dev, 4, 64, 4, 3
    page = (2, 16, 8, 64)                                 # K/V x 16 tokens x 8 heads x 64 dims, fp16
    gen = torch.Generator(device="cpu").manual_seed(31)

    def make(kind: str) -> list[torch.Tensor]:
        if kind == "one allocation":
            return list(torch.randn((layers_n, pages, *page), generator=gen).half().to(dev).unbind(0))
        if kind == "separate":
            return [torch.randn((pages, *page), generator=gen).half().to(dev) for _ in range(layers_n)]
        full = torch.randn((layers_n, pages, *page[:-1], page[-1] + 1), generator=gen).half().to(dev)
        return [full[i, ..., :page[-1]] for i in range(layers_n)]     # typed fallback

    ids = (torch.arange(n * per) * 5 % pages).view(n, per)          # host ids
    keep = torch.ones(n, per, dtype=torch.bool)
    keep[0, :2] = False                                              # host mask (a prefix-cache hit)
    counts: dict[str, int] = {}
    exact: dict[str, bool] = {}
    flat = ids.reshape(-1).tolist()
    kept = [p for p, k in zip(flat, keep.reshape(-1).tolist()) if k]
    for kind in ("one allocation", "separate", "typed"):
        src = make(kind)
        pl = PagedLayers(src, blocks_per_chunk=per)
        want = torch.cat([torch.cat([c[ids[i].to(dev)].contiguous().view(-1).view(torch.uint8) for c in src])
                          for i in range(n)])
        out = torch.empty(n * pl.chunk_bytes, dtype=torch.uint8, device=dev)
        out_l = torch.empty_like(out)
        dst = [torch.zeros_like(c) for c in src]
        dst_l = [torch.zeros_like(c) for c in src]
        ql, ql_l = PagedLayers(dst, blocks_per_chunk=per), PagedLayers(dst_l, blocks_per_chunk=per)
        dst_p = [torch.zeros_like(c) for c in src]
        plain = PagedLayers(dst_p, blocks_per_chunk=per)
        calls = {
            "gather": lambda: pl.gather(ids, out),
            f"gather_layer x{layers_n}": lambda: [pl.gather_layer(i, ids, out_l) for i in range(layers_n)],
            "scatter": lambda: plain.scatter(ids, want),
            "scatter keep": lambda: ql.scatter(ids, want, keep=keep),
            f"scatter_layer keep x{layers_n}": lambda: [ql_l.scatter_layer(i, ids, want, keep=keep)
                                                      for i in range(layers_n)],
        }
        if ctx.cuda:
            torch.cuda.synchronize(dev)                    # construction's uploads are not the hot path
        for name, call in calls.items():
            # counted from the first call on (the pinned host allocator's first blocks included)
            if ctx.cuda:
                counts[f"{kind}: {name}"] = _count_syncs(call)
            else:
                call()
        exact[f"{kind}: gather"] = torch.equal(out, want) and torch.equal(out_l, want)
        exact[f"{kind}: scatter keep"] = all(
            all(torch.equal(d[p], c[p]) for p in kept) and all(not d[p].any() for p in flat if p not in kept)
            for dd in (dst, dst_l) for d, c in zip(dd, src))
        exact[f"{kind}: scatter"] = all(torch.equal(d[p], c[p]) for d, c in zip(dst_p, src) for p in flat)
    cache = make("one allocation")[0]                      # the single-tensor helpers (SGLang)
    one_ids = ids.reshape(-1)
    buf = torch.empty(one_ids.numel() * cache[0].numel() * 2, dtype=torch.uint8, device=dev)
    back = torch.zeros_like(cache)
    if ctx.cuda:
        torch.cuda.synchronize(dev)
    for name, call in (("gather_pages", lambda: gather_pages(cache, 0, one_ids, buf)),
                       ("scatter_pages", lambda: scatter_pages(back, 0, one_ids, buf))):
        if ctx.cuda:
            counts[name] = _count_syncs(call)
        else:
            call()
    exact["gather_pages/scatter_pages"] = all(torch.equal(back[p], cache[p]) for p in flat)
    bad = [k for k, v in exact.items() if not v]
    syncing = {k: v for k, v in counts.items() if v}
    if ctx.cuda:
        note = (f"{sum(counts.values())} syncs over {len(counts)} call shapes (x{layers_n}: every layer "
                f"once){'; syncing: ' + str(syncing) if syncing else ''}")
    else:
        note = f"no CUDA: bytes of {len(exact)} call shapes only, sync debug mode not exercised"
    ok = not bad and not syncing
    row = verdict("paged host syncs per call", dev, ok, f"{note}; bytes exact={not bad}{' ' + str(bad) if bad else ''}")
    row["syncs_per_call"] = counts if ctx.cuda else None
    return [row]


__all__ = ["Context", "nvme_corrupt_payload", "paged_sync_free", "stale_pinning", "stream_order", "verdict"]
