"""Moves between tiers through the Store against the tier's own calls, side by side.

    python -m benchmarks.moves [--tiers nvme,mooncake] [--sizes 64KiB,1MiB] [--rounds 7]

Each round moves 64 MiB. A Store with a DRAM tier that holds exactly one round sits over
the tier under test:

- ``spill``: ``save`` of a round into the full DRAM tier, which evicts the round before
  and writes it down (the Store's write-back);
- ``prefetch``: ``prefetch`` of an earlier round from the tier back into DRAM (the blocks
  it evicts are already below, so nothing is written).

Each is shown next to the same bytes through the tier directly, in the same run:

- ``tier batch``: one ``write`` / ``read_into`` per round (the ceiling for the Store);
- ``tier per block``: one call per block, which is how the Store moved blocks before
  moves went in batches (``kvstore.store.copies.MOVE_BATCH_BYTES``).

Columns: Store / tier batch (what the Store's move costs over the tier's own batch: a DRAM
copy, eviction bookkeeping) and Store / tier per block (what batching the moves buys).
Writes ``benchmarks/results/moves.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from benchmarks._common import print_table, write_json
from kvstore.config import load_config, parse_size
from kvstore.store import Store
from kvstore.store.build import header_frames
from kvstore.testing import make_keys
from kvstore.tiers.dram import DramTier

ROUND = 64 << 20


def _nvme(stack: ExitStack, tmp: Path) -> tuple[dict, object]:
    from kvstore.tiers.nvme import NvmeTier

    path = str(tmp / "nvme")
    return {"name": "below", "kind": "nvme", "path": path, "capacity": "2GiB"}, NvmeTier(path, 2 << 30, name="below")


def _mooncake(stack: ExitStack, tmp: Path) -> tuple[dict, object]:
    from tests._mooncake import MooncakePool
    from kvstore.tiers.mooncake import MooncakeTier

    (tmp / "mooncake").mkdir()
    pool = MooncakePool(tmp / "mooncake", segment_mib=1536)
    stack.callback(pool.stop)
    prefix = f"moves{os.getpid()}"
    cfg = {"name": "below", "kind": "mooncake", "capacity": "1GiB", "master": pool.master,
           "metadata_server": pool.metadata, "prefix": prefix, "staging_bytes": "80MiB"}
    return cfg, MooncakeTier(1 << 30, master=pool.master, metadata_server=pool.metadata, name="below",
                             prefix=prefix, staging_bytes=80 << 20)


BELOW = {"nvme": _nvme, "mooncake": _mooncake}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(kind: str, block: int, rounds: int) -> list[dict]:
    n = ROUND // block
    srcs = [np.random.default_rng(i).integers(0, 256, block, dtype=np.uint8) for i in range(n)]
    dsts = [np.zeros(block, np.uint8) for _ in range(n)]
    t = {op: [] for op in ("spill", "prefetch", "batch write", "batch read", "block write", "block read")}
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstore-moves-", dir="/var/tmp")))
        cfg, tier = BELOW[kind](stack, tmp)
        dram_cfg = {"name": "hot", "kind": "dram", "capacity": n * block, "pin": False}
        config = load_config({"tiers": [dram_cfg, cfg]})
        # header frames where the Store's build gives them (a Mooncake tier below)
        hot = DramTier(n * block, name="hot", pin=False, header_frames=header_frames(config.tiers, 0))
        store = stack.enter_context(Store(config, tiers=[hot, tier]))
        saved = [make_keys(n, salt=f"{kind}{block}-{r}") for r in range(rounds + 2)]
        # Touch the room the Store phase will fill, through the tier, then free it: a pool's
        # (or a drive's) first write into fresh memory pays page faults the tier-direct
        # rounds below, which reuse freed room, would not.
        warm = [make_keys(n, salt=f"warm{kind}{block}-{r}") for r in range(rounds + 2)]
        for keys in warm:
            tier.write(keys, srcs)
        for keys in warm:
            tier.delete(keys)
        for r, keys in enumerate(saved):   # each save spills the round before it
            took = _timed(lambda: store.save(keys, srcs).result())
            if r >= 2:
                t["spill"].append(took)
        for keys in reversed(saved[:-1]):   # the first prefetch also spills the last round
            took = _timed(lambda: store.prefetch(keys).result())
            if keys is not saved[-2]:
                t["prefetch"].append(took)
        for r in range(rounds):
            keys = make_keys(n, salt=f"raw{kind}{block}-{r}")
            t["batch write"].append(_timed(lambda: tier.write(keys, srcs)))
            t["batch read"].append(_timed(lambda: tier.read_into(keys, dsts)))
            tier.delete(keys)
            keys = make_keys(n, salt=f"one{kind}{block}-{r}")
            t["block write"].append(_timed(lambda: [tier.write([k], [s]) for k, s in zip(keys, srcs)]))
            t["block read"].append(_timed(lambda: [tier.read_into([k], [d]) for k, d in zip(keys, dsts)]))
            tier.delete(keys)
    gbps = {op: ROUND / statistics.median(v) / 1e9 for op, v in t.items()}
    rows = []
    for op, batch, one in (("spill", "batch write", "block write"), ("prefetch", "batch read", "block read")):
        rows.append({"tier": kind, "block_bytes": block, "op": op, "store_gbps": gbps[op],
                     "tier_batch_gbps": gbps[batch], "tier_per_block_gbps": gbps[one],
                     "vs_batch": gbps[op] / gbps[batch], "vs_per_block": gbps[op] / gbps[one]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiers", default="nvme,mooncake")
    parser.add_argument("--sizes", default="64KiB,1MiB")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rows, skipped = [], {}
    for kind in args.tiers.split(","):
        if kind == "mooncake" and shutil.which("mooncake_master") is None:
            from tests import _mooncake

            reason = _mooncake.missing()
            if reason:
                skipped[kind] = reason
                continue
        for size in args.sizes.split(","):
            rows += measure(kind, parse_size(size), args.rounds)
    print_table(["tier", "block", "op", "Store GB/s", "tier batch GB/s", "tier per block GB/s", "Store/batch",
                 "Store/per block"],
                [[r["tier"], f"{r['block_bytes'] >> 10} KiB", r["op"], r["store_gbps"], r["tier_batch_gbps"],
                  r["tier_per_block_gbps"], r["vs_batch"], r["vs_per_block"]] for r in rows])
    for kind, reason in skipped.items():
        print(f"skipped {kind}: {reason}")
    path = write_json("moves", {"command": "python -m benchmarks.moves " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items()), "round_bytes": ROUND,
        "rows": rows, "skipped": skipped})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
