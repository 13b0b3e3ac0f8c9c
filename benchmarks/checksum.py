"""Host cost of the segmented payload checksum (``device_verify``) vs plain XXH3-64.

    python -m benchmarks.checksum

For 64 KiB, 256 KiB, 1 MiB and 4 MiB payloads, hashes the same bytes with today's
XXH3-64 (``block.checksum``) and with the segmented checksum (XXH3-64 per 64 KiB
segment, combined), taking turns round by round (drift-free ratios). Two cases: *hot*,
one payload hashed again and again (in cache: the per-segment call overhead shows most),
and *cold*, payloads taken in turn from a 256 MiB pool (out of cache, like a block
freshly read from disk). Target: segmented >= 0.8x of XXH3-64. Runs in well under a
minute; writes ``benchmarks/results/checksum.json``.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import xxhash

from benchmarks._common import print_table, write_json
from kvstore._segsum import SEGMENT_BYTES, segmented_checksum

SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
POOL_BYTES = 256 << 20
ROUNDS = 21
TARGET = 0.8


def _gbps(fn, views: list, calls: int) -> float:
    t0 = time.perf_counter()
    for i in range(calls):
        fn(views[i % len(views)])
    return calls * views[0].nbytes / (time.perf_counter() - t0) / 1e9


def measure(views: list, calls: int) -> tuple[float, float, float]:
    """Median GB/s of XXH3-64 and of the segmented checksum, and the median of the
    per-round ratios, over ``ROUNDS`` rounds taking turns (which goes first alternates)."""
    plain, seg, ratios = [], [], []
    _gbps(xxhash.xxh3_64_intdigest, views, calls)
    _gbps(segmented_checksum, views, calls)
    for r in range(ROUNDS):
        if r % 2:
            s = _gbps(segmented_checksum, views, calls)
            p = _gbps(xxhash.xxh3_64_intdigest, views, calls)
        else:
            p = _gbps(xxhash.xxh3_64_intdigest, views, calls)
            s = _gbps(segmented_checksum, views, calls)
        plain.append(p)
        seg.append(s)
        ratios.append(s / p)
    return statistics.median(plain), statistics.median(seg), statistics.median(ratios)


def main() -> None:
    pool = np.random.default_rng(0).integers(0, 256, POOL_BYTES, dtype=np.uint8)
    rows, results = [], []
    for n in SIZES:
        calls = max(8, (64 << 20) // n)   # 64 MiB hashed per round
        for case in ("hot", "cold"):
            views = [pool[:n]] if case == "hot" else [pool[i:i + n] for i in range(0, POOL_BYTES - n + 1, n)]
            plain, seg, ratio = measure(views, calls)
            results.append({"nbytes": n, "case": case, "xxh3_gbps": plain, "segmented_gbps": seg, "ratio": ratio})
            rows.append([f"{n >> 10} KiB", case, plain, seg, ratio, "ok" if ratio >= TARGET else f"< {TARGET}"])
    print_table(["payload", "case", "XXH3-64 GB/s", "segmented GB/s", "ratio", "target 0.8"], rows)
    path = write_json("checksum", {"segment_bytes": SEGMENT_BYTES, "target": TARGET, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
