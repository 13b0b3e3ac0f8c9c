"""The measuring half of ``kvstore bench``: fresh keys, distinct block contents, and one
round loop (save, optionally lookup, load, verify, delete) over anything with the
Store's API — a one-tier :class:`~kvstore.store.Store` or a :class:`~kvstore.Client`.

No torch: blocks are numpy ``uint8`` arrays."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.keys import BlockKey, Namespace

STAMP_BYTES = 8     # each block carries its index here, so no two blocks of a run are alike


@dataclass(frozen=True)
class Workload:
    block_bytes: int
    blocks: int       # per round
    batch: int        # blocks per save/load call
    rounds: int


class Blocks:
    """``batch`` random source buffers and as many destinations. Block ``i`` is source
    ``i % batch`` with ``i`` stamped into its first bytes: every block differs, yet a run
    allocates only two batches of memory."""

    def __init__(self, block_bytes: int, batch: int) -> None:
        rng = np.random.default_rng(secrets.randbits(64))
        self.srcs = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(batch)]
        self.dsts = [np.empty(block_bytes, np.uint8) for _ in range(batch)]
        self._stamp = min(STAMP_BYTES, block_bytes)

    def stamp(self, first: int, n: int) -> list[np.ndarray]:
        """The sources of blocks ``first .. first + n - 1``."""
        for j in range(n):
            self.srcs[j][:self._stamp] = np.frombuffer((first + j).to_bytes(8, "little"), np.uint8)[:self._stamp]
        return self.srcs[:n]


def fresh_namespace() -> Namespace:
    """A namespace no earlier run used (a random salt): every key of this run is new,
    so a save really writes and a load really reads what this run wrote."""
    return Namespace(model="kvstore-bench", dtype="uint8", chunk_tokens=1, salt=secrets.token_hex(16))


def round_keys(ns: Namespace, work: Workload, r: int) -> list[BlockKey]:
    return ns.chunk_keys(np.arange(r * work.blocks, (r + 1) * work.blocks, dtype=np.int64))


def measure(api: Any, work: Workload, *, lookup: bool = False, bar: Any = None) -> dict[str, Any]:
    """Run ``work`` against ``api`` and count what happened: ``saved`` (save said True),
    ``hits`` (load said True), ``verified`` (hits whose bytes match what was saved),
    ``corrupt`` (hits whose bytes do not), ``missing`` (saved but not loaded); seconds
    spent in save, load (and lookup) calls only. Each round's keys are deleted before
    the next round and on any way out, so ``api`` is left holding none of them."""
    ns, pool = fresh_namespace(), Blocks(work.block_bytes, work.batch)
    out: dict[str, Any] = {"block_bytes": work.block_bytes, "blocks": work.blocks * work.rounds,
                           "saved": 0, "hits": 0, "verified": 0, "corrupt": 0, "missing": 0,
                           "save_s": 0.0, "load_s": 0.0, "deleted": 0}
    if lookup:
        out.update(found=0, lookup_s=0.0)
    for r in range(work.rounds):
        keys = round_keys(ns, work, r)
        base = r * work.blocks
        saved: list[bool] = []
        try:
            for start in range(0, len(keys), work.batch):
                part = keys[start:start + work.batch]
                srcs = pool.stamp(base + start, len(part))
                t0 = time.perf_counter()
                ok = api.save(part, srcs).result()
                out["save_s"] += time.perf_counter() - t0
                saved += ok
                if bar is not None:
                    bar.update(len(part))
            out["saved"] += sum(saved)
            if lookup:
                t0 = time.perf_counter()
                out["found"] += api.lookup(keys)
                out["lookup_s"] += time.perf_counter() - t0
            for start in range(0, len(keys), work.batch):
                part = keys[start:start + work.batch]
                dsts = pool.dsts[:len(part)]
                t0 = time.perf_counter()
                hits = api.load(part, dsts).result()
                out["load_s"] += time.perf_counter() - t0
                srcs = pool.stamp(base + start, len(part))
                for j, hit in enumerate(hits):
                    if hit:
                        out["hits"] += 1
                        out["verified" if np.array_equal(dsts[j], srcs[j]) else "corrupt"] += 1
                    elif saved[start + j]:
                        out["missing"] += 1
                if bar is not None:
                    bar.update(len(part))
        finally:
            out["deleted"] += api.delete(keys)
    out["save_gbps"] = _gbps(out["saved"] * work.block_bytes, out["save_s"])
    out["load_gbps"] = _gbps(out["hits"] * work.block_bytes, out["load_s"])
    return out


def _gbps(nbytes: int, seconds: float) -> float | None:
    return nbytes / seconds / 1e9 if seconds > 0 and nbytes else None
