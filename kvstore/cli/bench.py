"""``kvstore bench``: save and load throughput of a Store built from a config."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from tqdm import tqdm

from kvstore.config import load_config, parse_size
from kvstore.keys import Namespace


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="measure save/load throughput on a config")
    parser.add_argument("--config", help="YAML config (default: $KVSTORE_CONFIG or built-in)")
    parser.add_argument("--block-size", default="1MiB", help="bytes per block (default 1MiB)")
    parser.add_argument("--blocks", type=int, default=256, help="blocks per round (default 256)")
    parser.add_argument("--batch", type=int, default=32, help="blocks per save/load call (default 32)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvstore.store import Store

    block = parse_size(args.block_size)
    ns = Namespace(model="kvstore-bench", dtype="uint8", chunk_tokens=1)
    srcs = [np.random.default_rng(i).integers(0, 256, block, dtype=np.uint8) for i in range(args.batch)]
    dsts = [np.empty(block, np.uint8) for _ in range(args.batch)]
    results = {"block_bytes": block, "blocks": args.blocks, "save_s": 0.0, "load_s": 0.0, "hits": 0}
    with Store(load_config(args.config)) as store:
        total = args.rounds * args.blocks
        with tqdm(total=2 * total, unit="block", desc="bench") as bar:
            for r in range(args.rounds):
                keys = ns.chunk_keys(np.arange(r * args.blocks, (r + 1) * args.blocks))
                for start in range(0, len(keys), args.batch):
                    batch = keys[start:start + args.batch]
                    t0 = time.perf_counter()
                    store.save(batch, srcs[:len(batch)]).result()
                    results["save_s"] += time.perf_counter() - t0
                    bar.update(len(batch))
                for start in range(0, len(keys), args.batch):
                    batch = keys[start:start + args.batch]
                    t0 = time.perf_counter()
                    results["hits"] += sum(store.load(batch, dsts[:len(batch)]).result())
                    results["load_s"] += time.perf_counter() - t0
                    bar.update(len(batch))
        results["stats"] = store.stats()
    nbytes = args.rounds * args.blocks * block
    results["save_gbps"] = nbytes / results["save_s"] / 1e9
    results["load_gbps"] = results["hits"] * block / results["load_s"] / 1e9
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    else:
        print(f"{'op':<6}{'GB/s':>8}  blocks of {block} B")
        print(f"{'save':<6}{results['save_gbps']:>8.2f}")
        print(f"{'load':<6}{results['load_gbps']:>8.2f}  hits {results['hits']}/{args.rounds * args.blocks}")
    return 0
