"""S3 tier throughput vs plain boto3, side by side on the same Swift (s3api) server.

For each block size and concurrency: PUT and GET throughput of ``S3Tier.write`` /
``S3Tier.read_into`` (block header, XXH3 checksum, verification, streaming into caller
buffers) and of plain ``put_object`` / ``get_object().read()`` on a thread pool of the
same size, same bytes, same client settings (one ``S3Settings`` builds both clients).
Each cell runs ``--repeats`` back-to-back pairs, alternating which client goes first; ratios are medians of the per-pair ratios, so load
from other jobs on a shared machine cancels out. Client CPU per block (whole process,
``time.process_time``) is printed beside each throughput: it shows what the header,
checksum and verification cost, independent of the server's speed. The Swift servers'
CPU per block is printed too, and the ratio of boto3's to the tier's client + server CPU
per block: on a machine shared with other jobs, where wall-clock throughput swings with
their load, CPU spent per block is the steadier comparison.

    python -m benchmarks.s3 [--sizes 1,4] [--concurrency 1,4,8] [--large 24] [--mib-per-cell 48] [--repeats 7]
                            [--sign-payload]

Prints a table and writes benchmarks/results/s3.json and s3.png. Needs Swift
(scripts/deps/20-swift.sh), started here exactly as the tests start it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import RESULTS, write_json  # noqa: E402
from kvstore.testing import make_keys  # noqa: E402
from tests._swift import REGION, SwiftServer, aws_env  # noqa: E402
from kvstore.tiers.s3.client import S3Settings, make_client  # noqa: E402
from kvstore.tiers.s3 import S3Tier  # noqa: E402

BUCKET = "kvstore-bench"
MiB = 1 << 20


def settings(endpoint: str, concurrency: int, sign_payload: bool) -> S3Settings:
    """One set of connection settings for both clients of a cell."""
    return S3Settings(name="bench", bucket=BUCKET, endpoint_url=endpoint, region=REGION, addressing_style="path",
                      concurrency=concurrency, sign_payload=sign_payload)


def raw_client(s: S3Settings):
    """Plain boto3 with exactly the tier's client configuration (timeouts, retries, pool,
    payload signing, no flexible checksums), so only what the tier adds differs."""
    return make_client(s, pool_connections=2 * s.concurrency)


def _timed(server: SwiftServer, fn) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of this whole process, CPU seconds of the Swift
    servers) of one call."""
    w, c, s = time.perf_counter(), time.process_time(), server.cpu_seconds()
    fn()
    return time.perf_counter() - w, time.process_time() - c, server.cpu_seconds() - s


def bench_raw(server: SwiftServer, client, blocks: list[bytes], concurrency: int, tag: str) -> dict[str, float]:
    names = [f"raw/{tag}/{i}" for i in range(len(blocks))]
    total = sum(len(b) for b in blocks)
    got: list[bytes] = []
    with ThreadPoolExecutor(concurrency) as pool:
        put = _timed(server, lambda: list(pool.map(lambda nb: client.put_object(Bucket=BUCKET, Key=nb[0], Body=nb[1]),
                                           zip(names, blocks))))
        get = _timed(server, lambda: got.extend(pool.map(lambda n: client.get_object(Bucket=BUCKET, Key=n)["Body"].read(),
                                                 names)))
    assert sum(len(g) for g in got) == total
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda n: client.delete_object(Bucket=BUCKET, Key=n), names))
    return _rates(total, len(blocks), put, get)


def _rates(total: int, n: int, put: tuple[float, ...], get: tuple[float, ...]) -> dict[str, float]:
    return {"put": total / put[0], "get": total / get[0], "put_cpu_ms": put[1] / n * 1e3,
            "get_cpu_ms": get[1] / n * 1e3, "put_server_cpu_ms": put[2] / n * 1e3,
            "get_server_cpu_ms": get[2] / n * 1e3}


def bench_tier(server: SwiftServer, tier: S3Tier, srcs: list[np.ndarray], tag: str) -> dict[str, float]:
    keys = make_keys(len(srcs), salt=tag)
    total = sum(s.nbytes for s in srcs)
    dsts = [np.empty_like(s) for s in srcs]
    for d in dsts:
        d.fill(0)
    put = _timed(server, lambda: tier.write(keys, srcs))
    get = _timed(server, lambda: tier.read_into(keys, dsts))
    assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts)), "S3Tier returned wrong bytes"
    tier.delete(keys)
    return _rates(total, len(srcs), put, get)


def run_cell(server: SwiftServer, srcs: list[np.ndarray], blobs: list[bytes], size: int, conc: int,
             repeats: int, variant: str = "default", sign_payload: bool = False, **tier_kwargs) -> dict:
    """``repeats`` back-to-back pairs (boto3 then kvstore, or the reverse, alternating).
    Ratios are medians of the per-pair ratios, so load that drifts during the run (other
    jobs on the machine) cancels out; throughput and CPU figures are medians too."""
    s = settings(server.endpoint_url, conc, sign_payload)
    client = raw_client(s)
    tier = S3Tier(4 * len(srcs) * size * MiB, name=s.name, bucket=BUCKET, prefix="kv",
                  endpoint_url=s.endpoint_url, region=s.region, addressing_style=s.addressing_style,
                  concurrency=conc, sign_payload=sign_payload, **tier_kwargs)
    runs: dict[str, list[dict[str, float]]] = {"raw": [], "kv": []}
    try:
        for r in range(repeats):
            tag = f"{size}-{conc}-{r}-{uuid.uuid4().hex[:6]}"
            for which in (("raw", "kv") if r % 2 == 0 else ("kv", "raw")):
                runs[which].append(bench_raw(server, client, blobs, conc, tag) if which == "raw"
                                   else bench_tier(server, tier, srcs, tag))
        stats = tier.stats()
    finally:
        tier.close()
        client.close()
    row = {"block_mib": size, "concurrency": conc, "blocks": len(srcs), "repeats": repeats, "variant": variant,
           "sign_payload": sign_payload,
           "multipart_put": stats["multipart_puts"] > 0, "ranged_get": stats["ranged_gets"] > 0}
    for which, got in runs.items():
        for k in got[0]:
            v = float(np.median([g[k] for g in got]))
            row[f"{which}_{k}"] = v if k.endswith("cpu_ms") else v / 1e6
    for op in ("put", "get"):  # client + server CPU per block: what the box spends, whatever else runs
        row[f"{op}_cpu_ratio"] = float(np.median([(r[f"{op}_cpu_ms"] + r[f"{op}_server_cpu_ms"])
                                                  / (k[f"{op}_cpu_ms"] + k[f"{op}_server_cpu_ms"])
                                                  for k, r in zip(runs["kv"], runs["raw"])]))
    for op in ("put", "get"):
        row[f"{op}_ratio"] = float(np.median([k[op] / r[op] for k, r in zip(runs["kv"], runs["raw"])]))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4", help="block sizes in MiB, comma-separated")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--large", type=int, default=24,
                    help="also one row of blocks this many MiB at concurrency 1 (multipart PUT, "
                         "ranged parallel GET); 0 to skip")
    ap.add_argument("--mib-per-cell", type=int, default=48, help="bytes moved per measurement")
    ap.add_argument("--repeats", type=int, default=7, help="paired runs per cell")
    ap.add_argument("--sign-payload", action="store_true",
                    help="both clients SHA-256-sign PUT bodies (botocore's default over http)")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    concs = [int(x) for x in args.concurrency.split(",")]
    cells = [(size, conc) for size in sizes for conc in concs]
    if args.large:
        cells.append((args.large, 1))

    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the servers below are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="kvstore-s3-bench-") as root:
        server = SwiftServer(root)
        os.environ.update(aws_env(server, root))
        with server:
            server.client().create_bucket(Bucket=BUCKET)
            rows, data = [], {}
            for size, conc in cells:
                if size not in data:  # one set of blocks per size, generated once
                    rng = np.random.default_rng(size)
                    srcs = [rng.integers(0, 256, size * MiB, dtype=np.uint8)
                            for _ in range(max(4, args.mib_per_cell // size))]
                    data = {size: (srcs, [s.tobytes() for s in srcs])}
                rows.append(run_cell(server, *data[size], size, conc, args.repeats, sign_payload=args.sign_payload))
                print_row(rows[-1], header=len(rows) == 1)
                if size == args.large:  # the same blocks sent as one PUT each, still read in ranges
                    rows.append(run_cell(server, *data[size], size, conc, args.repeats, variant="single PUT",
                                         sign_payload=args.sign_payload, multipart_threshold=1 << 40))
                    print_row(rows[-1], header=False)
    out = write_json("s3", {"server": "OpenStack Swift s3api on 127.0.0.1", "unit": "MB/s",
                            "mib_per_cell": args.mib_per_cell, "repeats": args.repeats, "rows": rows})
    plot(rows, RESULTS / "s3.png")
    print(f"wrote {out} and {RESULTS / 's3.png'}")


def print_row(row: dict, *, header: bool) -> None:
    if header:
        cols = f"{'boto3':>6} {'kvstore':>7} {'ratio':>6} {'client ms':>10} {'server ms':>10} {'cpu':>6}"
        print(f"{'block':>6} {'conc':>4} {'variant':>10} | {'PUT MB/s':^49} | {'GET MB/s':^49}")
        print(f"{'':>23} | {cols} | {cols}")
        print(f"{'':>23} | {'':>21} {'boto3/kv':>10} {'boto3/kv':>10} {'ratio':>6} |"
              f" {'':>21} {'boto3/kv':>10} {'boto3/kv':>10} {'ratio':>6}   (medians of paired runs; "
              f"cpu ratio = boto3/kvstore client+server CPU per block)")
    cells = []
    for op in ("put", "get"):
        client = f"{row[f'raw_{op}_cpu_ms']:.1f}/{row[f'kv_{op}_cpu_ms']:.1f}"
        server = f"{row[f'raw_{op}_server_cpu_ms']:.1f}/{row[f'kv_{op}_server_cpu_ms']:.1f}"
        cells.append(f"{row[f'raw_{op}']:>6.0f} {row[f'kv_{op}']:>7.0f} {row[f'{op}_ratio']:>5.2f}x {client:>10} "
                     f"{server:>10} {row[f'{op}_cpu_ratio']:>5.2f}x")
    print(f"{row['block_mib']:>4}Mi {row['concurrency']:>4} {row['variant']:>10} | {cells[0]} | {cells[1]}",
          flush=True)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    labels = [f"{r['block_mib']}MiB×{r['concurrency']}" + ("" if r["variant"] == "default" else "\n" + r["variant"])
              for r in rows]
    x = np.arange(len(rows))
    for ax, op in zip(axes, ("put", "get")):
        ax.bar(x - 0.2, [r[f"raw_{op}"] for r in rows], 0.4, label="boto3 put/get_object")
        ax.bar(x + 0.2, [r[f"kv_{op}"] for r in rows], 0.4, label="kvstore S3Tier")
        ax.set_xticks(x, labels, rotation=30)
        ax.set_title(f"{op.upper()} throughput (MB/s), Swift s3api on loopback")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
