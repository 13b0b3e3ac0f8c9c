"""kvstore's NVMe tier beside LMCache's ``fs_native``, batch by batch in one process.

``benchmarks/nvme.py`` runs each contender's whole write and read phases in turn, so a
repetition's two figures are taken seconds apart, and on these VMs the disk's speed
drifts by ±15% in that time. Here both stores live in one process and take turns batch
by batch. Each repetition writes 64 blocks to kvstore, 64 to fs_native, and so on,
then reads them back the same way. The order within a pair flips every batch and every
repetition. Drift then hits both alike, and each repetition's ratio compares the two
stores on the same seconds of the disk.

- ``kvstore``: ``NvmeTier.write`` / ``read_into`` from and to page-aligned host buffers,
  every block checked on read. Read-ahead is off: it would read kvstore's next batch
  while fs_native's batch is being timed.
- ``fs_native``: as in ``nvme.py`` (``benchmarks/_lmcache_disk.py``). It gets O_DIRECT
  and a new directory every repetition, its files deleted after it.

Neither write phase includes the ``sync`` that follows it, since that sync serves both.
Reads start after it, cold. This needs LMCache. Run it with a Python that has it, or
pass ``--lmcache-python`` and the script runs itself again under that Python:

    python benchmarks/nvme_paired.py --lmcache-python /path/to/venv/bin/python [--sizes 256KiB,1MiB,4MiB] [--reps 8]

Prints medians and the per-repetition ratios, and writes
``benchmarks/results/nvme_paired.json``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from benchmarks._common import print_table  # noqa: E402
from benchmarks._nvme_setup import block_buffers, per_size, save_rows, size_options  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402
from kvstore.tiers.nvme.io import extent_bytes  # noqa: E402
from kvstore.tiers.nvme import NvmeTier  # noqa: E402

BATCH = 64


def bench_size(base: str, block: int, total: int, reps: int) -> dict:
    import torch

    from benchmarks._lmcache_disk import FsNative

    n = max(BATCH, total // block // BATCH * BATCH)
    src, dst, srcs, dsts = block_buffers(block, n)
    tier = NvmeTier(os.path.join(base, f"kv-{block}"), int(extent_bytes(block) * n * 1.1), name="bench",
                    file_bytes=1 << 30, io_threads=16, readahead_bytes=0)
    fs = FsNative(os.path.join(base, f"fs-{block}"), block, n)
    for obj, view in zip(fs.src, srcs):
        obj.tensor.copy_(torch.from_numpy(view))
    got: dict[str, dict[str, list[float]]] = {"write": {"kvstore": [], "fs_native": []},
                                              "read": {"kvstore": [], "fs_native": []}}
    try:
        for rep in range(reps):
            keys = Namespace(model="bench", dtype="u8", chunk_tokens=1, salt=f"paired-{block}-{rep}") \
                .chunk_keys(np.arange(n))
            fkeys = fs.keys(rep * n, n)
            steps = {
                "write": {"kvstore": lambda s: tier.write(keys[s:s + BATCH], srcs[s:s + BATCH]),
                          "fs_native": lambda s: fs.store(fkeys[s:s + BATCH], fs.src[s:s + BATCH])},
                "read": {"kvstore": lambda s: tier.read_into(keys[s:s + BATCH], dsts[s:s + BATCH]),
                         "fs_native": lambda s: fs.load(fkeys[s:s + BATCH], fs.dst[s:s + BATCH])},
            }
            os.sync()
            for phase in ("write", "read"):
                spent = {"kvstore": 0.0, "fs_native": 0.0}
                for i, s in enumerate(range(0, n, BATCH)):
                    order = ("kvstore", "fs_native") if (i + rep) % 2 == 0 else ("fs_native", "kvstore")
                    for who in order:
                        t0 = time.perf_counter()
                        ok = steps[phase][who](s)
                        spent[who] += time.perf_counter() - t0
                        if who == "kvstore" and not all(ok):
                            raise RuntimeError(f"kvstore {phase} refused a block of batch {i}")
                for who, seconds in spent.items():
                    got[phase][who].append(n * block / seconds / 1e9)
                if phase == "write":
                    tier.flush_access()   # the last index commit, then one sync for both
                    os.sync()
            if not (np.array_equal(dst, src) and torch.equal(fs.dst[-1].tensor, fs.src[-1].tensor)):
                raise RuntimeError("a store returned different bytes")
            dst[:] = 0
            tier.delete(keys)
            fs.renew()   # fs_native starts each repetition on an empty directory
    finally:
        tier.close()
        fs.close()
    ratios = {phase: [k / f for k, f in zip(v["kvstore"], v["fs_native"])] for phase, v in got.items()}
    return {"block_bytes": block, "blocks": n, "batch": BATCH, "reps": reps,
            "GBps": {phase: {who: statistics.median(x) for who, x in v.items()} for phase, v in got.items()},
            "samples": got, "kvstore_over_fs_native": ratios,
            "ratio_median": {phase: statistics.median(r) for phase, r in ratios.items()}}


def main() -> int:
    parser = size_options(__doc__, bytes_default="512MiB", reps_default=8)
    parser.add_argument("--lmcache-python", default=os.environ.get("LMCACHE_PYTHON"),
                        help="a Python with lmcache==0.5.6 installed (this script runs itself under it)")
    args = parser.parse_args()
    try:
        import lmcache  # noqa: F401
    except ImportError:
        python = args.lmcache_python
        if not python or not os.path.exists(python):
            parser.error("LMCache is not importable here: pass --lmcache-python (a venv with lmcache==0.5.6)")
        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        os.execv(python, [python, os.path.abspath(__file__), *sys.argv[1:]])
    rows = per_size(args, "nvme-paired", bench_size)
    print_table(["block", "kvstore w / r GB/s", "fs_native w / r GB/s", "kvstore / fs_native (w, r)",
                 "read ratio per repetition"],
                [[f"{row['block_bytes'] >> 10} KiB",
                  f"{row['GBps']['write']['kvstore']:.2f} / {row['GBps']['read']['kvstore']:.2f}",
                  f"{row['GBps']['write']['fs_native']:.2f} / {row['GBps']['read']['fs_native']:.2f}",
                  f"{row['ratio_median']['write']:.2f}, {row['ratio_median']['read']:.3f}",
                  " ".join(f"{r:.2f}" for r in row["kvstore_over_fs_native"]["read"])] for row in rows])
    print("(medians; ratios are medians of per-repetition ratios, both stores timed batch by batch)")
    save_rows("nvme_paired", rows)
    sys.stdout.flush()
    os._exit(0)   # LMCache leaves non-daemon threads behind


if __name__ == "__main__":
    sys.exit(main())
