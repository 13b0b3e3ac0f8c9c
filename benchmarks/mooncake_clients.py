"""How the mooncake tier's ratio depends on which Mooncake client instance is the baseline.

    python -m benchmarks.mooncake_clients [--block-kib 1024] [--blocks 64] [--repeat 15]

In one process, on one pool, interleaved rounds (the order reversed every round) of one
batch each through: the mooncake tier; raw ``batch_get_into`` / ``batch_put_from`` on the
tier's own ``MooncakeDistributedStore`` instance (``own``); the same raw calls on a second
client instance (``sep``, what ``benchmarks/cluster.py`` compared against before). Prints
the medians of per-round ratios (raw time / tier time: above 1 the tier is faster) and
``own/sep``: the identical raw operation through two instances, which should read 1.0;
how far it is from 1.0 from one run to the next is how much a second-client baseline
measures the instance rather than the tier. Writes benchmarks/results/mooncake_clients.json.
Each raw side reads and writes its own registered buffers; the tier its own unregistered ones.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import print_table, write_json  # noqa: E402


def measure(block_bytes: int, blocks: int, repeat: int) -> list[dict]:
    from mooncake.store import MooncakeDistributedStore

    from kvstore.testing import free_port, make_keys
    from kvstore.tiers.mooncake import MooncakeTier
    from tests._mooncake import MooncakePool

    batch = block_bytes * blocks
    runs = itertools.count()
    with tempfile.TemporaryDirectory() as tmp:
        pool = MooncakePool(Path(tmp), segment_mib=max(512, 8 * batch >> 20))
        try:
            tier = MooncakeTier(4 * batch, master=pool.master, metadata_server=pool.metadata,
                                staging_bytes=batch + blocks * 4096, prefix="bench")
            sep = MooncakeDistributedStore()
            assert sep.setup(f"127.0.0.1:{free_port()}", pool.metadata, 0, 64 << 20, "tcp", "", pool.master) == 0
            src = np.random.default_rng(0).integers(0, 256, batch, dtype=np.uint8)
            sides = {}
            for name, client in (("own", tier._store), ("sep", sep)):
                buf, out = src.copy(), np.zeros(batch, np.uint8)
                assert client.register_buffer(buf.ctypes.data, batch) == 0
                assert client.register_buffer(out.ctypes.data, batch) == 0
                sides[name] = (client, buf, out)
            tier_dst = np.zeros(batch, np.uint8)
            srcs = [src[i * block_bytes:(i + 1) * block_bytes] for i in range(blocks)]
            dsts = [tier_dst[i * block_bytes:(i + 1) * block_bytes] for i in range(blocks)]
            sizes = [block_bytes] * blocks
            get_keys = make_keys(blocks, salt="get")
            assert tier.write(get_keys, srcs) == [True] * blocks
            for name, (client, buf, _) in sides.items():
                ptrs = [buf.ctypes.data + i * block_bytes for i in range(blocks)]
                assert client.batch_put_from([f"{name}get:{i}" for i in range(blocks)], ptrs, sizes) == [0] * blocks

            def raw_get(name):
                client, _, out = sides[name]
                names = [f"{name}get:{i}" for i in range(blocks)]
                ptrs = [out.ctypes.data + i * block_bytes for i in range(blocks)]

                def timed() -> float:
                    t0 = time.perf_counter()
                    assert client.batch_get_into(names, ptrs, sizes) == sizes
                    return time.perf_counter() - t0
                return timed

            def raw_put(name):
                client, buf, _ = sides[name]
                ptrs = [buf.ctypes.data + i * block_bytes for i in range(blocks)]

                def timed() -> float:
                    names = [f"{name}put{next(runs)}:{i}" for i in range(blocks)]
                    t0 = time.perf_counter()
                    assert client.batch_put_from(names, ptrs, sizes) == [0] * blocks
                    dt = time.perf_counter() - t0
                    client.batch_remove(names, True)
                    return dt
                return timed

            def tier_get() -> float:
                t0 = time.perf_counter()
                assert tier.read_into(get_keys, dsts) == [True] * blocks
                return time.perf_counter() - t0

            def tier_put() -> float:
                keys = make_keys(blocks, salt=f"put{next(runs)}")
                t0 = time.perf_counter()
                assert tier.write(keys, srcs) == [True] * blocks
                dt = time.perf_counter() - t0
                tier.delete(keys)
                return dt

            rows = []
            for op, fns in (("get", {"tier": tier_get, "own": raw_get("own"), "sep": raw_get("sep")}),
                            ("put", {"tier": tier_put, "own": raw_put("own"), "sep": raw_put("sep")})):
                times: dict[str, list[float]] = {k: [] for k in fns}
                order = list(fns)
                for r in range(repeat + 1):
                    for k in order if r % 2 else order[::-1]:
                        dt = fns[k]()
                        if r:   # the first round warms connections and pages up
                            times[k].append(dt)

                def ratio(a: str, b: str) -> float:
                    return statistics.median(x / y for x, y in zip(times[a], times[b]))

                rows.append({"op": op, "block_bytes": block_bytes, "blocks": blocks, "rounds": repeat,
                             "tier_vs_own": ratio("own", "tier"), "tier_vs_sep": ratio("sep", "tier"),
                             "own_vs_sep": ratio("sep", "own"),
                             **{f"{k}_gbps": batch / statistics.median(v) / 1e9 for k, v in times.items()}})
            for client, buf, out in sides.values():
                client.unregister_buffer(buf.ctypes.data)
                client.unregister_buffer(out.ctypes.data)
            sep.close()
            tier.close()
            return rows
        finally:
            pool.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-kib", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args(argv)
    rows = measure(args.block_kib << 10, args.blocks, args.repeat)
    print_table(["op", "tier / own client", "tier / second client", "own / second (identical)", "tier GB/s",
                 "own GB/s", "second GB/s"],
                [[r["op"], r["tier_vs_own"], r["tier_vs_sep"], r["own_vs_sep"], r["tier_gbps"], r["own_gbps"],
                  r["sep_gbps"]] for r in rows])
    path = write_json("mooncake_clients", {"command": "python -m benchmarks.mooncake_clients "
                                           + " ".join(argv or sys.argv[1:]), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
