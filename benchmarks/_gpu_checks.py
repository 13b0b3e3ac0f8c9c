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
- paged gather/scatter under ``torch.cuda.set_sync_debug_mode("error")``: no host sync,
  and the bytes moved are right.
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
    from tiers.dram import DramTier

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
    from tiers.nvme import NvmeTier

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


def paged_sync_free(ctx: Context) -> list[dict]:
    """The connectors' hot path (host-side ids and keep masks, as the scheduler lists
    them) makes no host<->device synchronisation: torch's sync debug mode raises on one.
    The bytes gathered and scattered are checked afterwards."""
    from kvstore.paged import PagedLayers

    pages = 64
    cache = torch.randn((pages, 2, 16, 8, 128), dtype=torch.float16, device=ctx.dev)
    layers = PagedLayers([cache], blocks_per_chunk=4)
    ids = torch.arange(8).view(2, 4) * 3                  # host ids: pages 0, 3, ..., 21
    keep = torch.ones(2, 4, dtype=torch.bool)
    keep[0, 0] = False                                    # host mask (a prefix-cache hit)
    buf = torch.empty(2 * layers.chunk_bytes, dtype=torch.uint8, device=ctx.dev)
    target = torch.zeros_like(cache)
    layers_target = PagedLayers([target], blocks_per_chunk=4)
    note, synced = "no CUDA: bytes only, sync debug mode not exercised", False
    if ctx.cuda:
        torch.cuda.synchronize(ctx.dev)
        torch.cuda.set_sync_debug_mode("error")
    try:
        layers.gather(ids, buf)
        layers_target.scatter(ids, buf, keep=keep)
        if ctx.cuda:
            note = "0 syncs (sync debug mode 'error')"
    except RuntimeError as exc:
        if not ctx.cuda:
            raise
        note, synced = f"synchronised: {exc}"[:120], True
    finally:
        if ctx.cuda:
            torch.cuda.set_sync_debug_mode(0)
    flat = ids.reshape(-1).tolist()
    kept = [p for p, k in zip(flat, keep.reshape(-1).tolist()) if k]
    skipped = [p for p in flat if p not in kept]
    exact = (all(torch.equal(target[p], cache[p]) for p in kept)
             and all(not target[p].any() for p in skipped)
             and torch.equal(buf.view(torch.float16).view(8, *cache.shape[1:]), cache[flat]))
    return [verdict("paged host syncs per call", ctx.dev, exact and not synced, f"{note}; bytes exact={exact}")]


__all__ = ["Context", "nvme_corrupt_payload", "paged_sync_free", "stale_pinning", "stream_order", "verdict"]
