"""NVMe tier throughput beside fio and LMCache 0.5.6's disk paths, in one run.

For each block size (256 KiB, 1 MiB, 4 MiB) and batches of 64 blocks, every repetition
runs each contender once in turn (interleaved), then the table shows medians:

- ``kvstore``: ``NvmeTier.write``/``read_into`` from/to page-aligned host buffers (what
  the DRAM tier's slots are), default config (O_DIRECT, index fsync per batch).
- ``fio``: ``direct=1``, ``iodepth=16``, libaio, same directory and block size — the
  device's limit.
- ``lmcache-disk`` / ``lmcache-fs-native``: LMCache's in-process ``LocalDiskBackend``
  and its ``fs_native`` L2 adapter with O_DIRECT, run by ``benchmarks/_lmcache_disk.py``
  under the Python named by ``--lmcache-python`` (a venv holding LMCache; see
  MACHINE.md). A contender that cannot run is reported as skipped, never estimated.

Every contender is timed the same way. A write phase ends when the data is on the
disk: its last step, inside the timing, is a ``sync`` (kvstore first waits for its last
index commit), so a path that writes through the page cache pays for the write-back
instead of reporting the speed of a memory copy. A read phase starts cold, after that
sync: direct I/O bypasses the page cache, and files read through the page cache are
dropped first (``drop_caches`` when root, else ``posix_fadvise``). fio's writes are
direct and unsynced (its job ends before the harness can sync); it reads after a sync.

Also measured: opening a tier whose index holds ``--index-entries`` entries (restart
time) and ``fsck`` throughput. Writes ``benchmarks/results/nvme.json`` and ``nvme.png``.

    python benchmarks/nvme.py [--dir DIR] [--reps 9] [--lmcache-python PATH]

Each repetition starts one contender later than the last (rotated order), and the table
is followed by kvstore's per-repetition ratios to every other contender and their
medians. A quick focused run: ``--sizes 4MiB --contenders kvstore,lmcache-fs-native
--skip-extras --out /tmp/nvme-quick.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from kvstore.config import parse_size  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402
from kvstore.tiers.nvme.fsck import fsck  # noqa: E402
from kvstore.tiers.nvme.index import BlockIndex, Record  # noqa: E402
from kvstore.tiers.nvme.io import aligned_empty, extent_bytes  # noqa: E402
from kvstore.tiers.nvme import NvmeTier  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")


def drop_page_cache(paths: list[str]) -> None:
    """Evict ``paths`` (files or directories) from the page cache."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return
    except OSError:
        pass
    for top in paths:
        for dirpath, _, files in os.walk(top) if os.path.isdir(top) else [("", [], [top])]:
            for name in files:
                try:
                    fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


class KvstoreRunner:
    name = "kvstore"

    def __init__(self, directory: str, block: int, nblocks: int, batch: int) -> None:
        self.dir, self.block, self.n, self.batch = directory, block, nblocks, batch
        self.src = aligned_empty(block * nblocks)
        self.src[:] = np.random.default_rng(0).integers(0, 256, self.src.nbytes, dtype=np.uint8)
        self.dst = aligned_empty(block * nblocks)
        self.dst[:] = 0   # pre-touch: first-touch faults are slow on these VMs
        self.rep = 0
        self.tier = NvmeTier(directory, int(extent_bytes(block) * nblocks * 1.1), name="bench",
                             file_bytes=1 << 30, io_threads=16)

    def run(self) -> tuple[float, float]:
        ns = Namespace(model="bench", dtype="u8", chunk_tokens=1, salt=f"{self.block}-{self.rep}")
        self.rep += 1
        keys = ns.chunk_keys(np.arange(self.n))
        srcs = [self.src[i * self.block:(i + 1) * self.block] for i in range(self.n)]
        dsts = [self.dst[i * self.block:(i + 1) * self.block] for i in range(self.n)]
        t0 = time.perf_counter()
        for i in range(0, self.n, self.batch):
            assert all(self.tier.write(keys[i:i + self.batch], srcs[i:i + self.batch]))
        self.tier.flush_access()   # waits for the last batch's index commit
        os.sync()
        t_write = time.perf_counter() - t0
        if self.tier.io_mode != "direct":
            drop_page_cache([self.dir])
        t0 = time.perf_counter()
        for i in range(0, self.n, self.batch):
            assert all(self.tier.read_into(keys[i:i + self.batch], dsts[i:i + self.batch]))
        t_read = time.perf_counter() - t0
        assert np.array_equal(self.dst[:self.block], self.src[:self.block])
        self.tier.delete(keys)
        total = self.block * self.n
        return total / t_write, total / t_read

    def close(self) -> None:
        self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class FioRunner:
    name = "fio"

    def __init__(self, directory: str, block: int, nblocks: int, batch: int) -> None:
        self.dir, self.block, self.size = directory, block, block * nblocks
        os.makedirs(directory, exist_ok=True)
        self.available = shutil.which("fio") is not None

    def _fio(self, rw: str) -> float:
        cmd = ["fio", "--name=bench", f"--directory={self.dir}", f"--rw={rw}", f"--bs={self.block}",
               "--direct=1", "--iodepth=16", "--ioengine=libaio", f"--size={self.size}",
               "--numjobs=1", "--group_reporting", "--output-format=json"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        job = json.loads(out[out.index("{"):])["jobs"][0]
        return float(job["write" if rw == "write" else "read"]["bw_bytes"])

    def run(self) -> tuple[float, float]:
        write = self._fio("write")
        os.sync()
        return write, self._fio("read")

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class LmcacheRunner:
    """Runs one LMCache path in a child process (its own Python with LMCache)."""

    def __init__(self, mode: str, python: str | None, directory: str, block: int, nblocks: int,
                 batch: int) -> None:
        self.name = f"lmcache-{mode}"
        self.mode, self.python, self.dir = mode, python, directory
        self.block, self.n, self.batch = block, nblocks, batch
        self.reason = None if python and os.path.exists(python) else "no LMCache Python (--lmcache-python)"

    def run(self) -> tuple[float, float]:
        os.makedirs(self.dir, exist_ok=True)
        cmd = [self.python, os.path.join(ROOT, "benchmarks", "_lmcache_disk.py"), "--mode", self.mode,
               "--dir", self.dir, "--block", str(self.block), "--blocks", str(self.n),
               "--batch", str(self.batch)]
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONWARNINGS": "ignore"}
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        shutil.rmtree(self.dir, ignore_errors=True)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        if res.returncode != 0 or not lines:
            self.reason = (res.stderr.strip().splitlines() or ["failed"])[-1][:200]
            raise RuntimeError(self.reason)
        got = json.loads(lines[-1])
        return got["write_Bps"], got["read_Bps"]

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def bench_sizes(args, base: str) -> list[dict]:
    rows = []
    for size_text in args.sizes.split(","):
        block = parse_size(size_text)
        nblocks = max(args.batch, args.bytes // block // args.batch * args.batch)
        # a fresh tier directory per size: a directory left by a smaller size holds data
        # files sized for that run's budget, which would cap (or fragment) this one
        runners = [KvstoreRunner(os.path.join(base, f"kv-{block}"), block, nblocks, args.batch),
                   FioRunner(os.path.join(base, "fio"), block, nblocks, args.batch)]
        if not args.skip_lmcache:
            runners += [LmcacheRunner(m, args.lmcache_python, os.path.join(base, f"lmc-{m}"), block,
                                      nblocks, args.batch) for m in ("disk", "fs-native")]
        if args.contenders:
            runners = [r for r in runners if r.name in args.contenders]
        got: dict[str, list[tuple[float, float]]] = {r.name: [] for r in runners}
        by_rep: list[dict[str, tuple[float, float]]] = []
        skipped: dict[str, str] = {}
        for rep in range(args.reps):
            # each repetition starts one contender later, so none always runs in the same
            # slot (right after the same neighbour's deletes, or first after a size change)
            order = runners[rep % len(runners):] + runners[:rep % len(runners)]
            by_rep.append({})
            for r in order:
                if r.name in skipped or getattr(r, "available", True) is False:
                    skipped.setdefault(r.name, "fio is not installed")
                    continue
                if getattr(r, "reason", None) and not got[r.name]:
                    skipped[r.name] = r.reason
                    continue
                # settle the disk first: the previous contender's deleted files and dirty
                # pages are flushed (and, on a file system mounted with discard, trimmed)
                # at the next journal commit, which must not land inside this measurement
                os.sync()
                try:
                    got[r.name].append(r.run())
                    by_rep[-1][r.name] = got[r.name][-1]
                except Exception as exc:  # a contender that fails is reported, not estimated
                    skipped[r.name] = getattr(r, "reason", None) or repr(exc)[:200]
                    print(f"  {r.name} failed: {exc!r}", file=sys.stderr)
                    traceback.print_exc()
            print(f"  {size_text} rep {rep + 1}/{args.reps} done", file=sys.stderr)
        for r in runners:
            r.close()
        row = {"block_bytes": block, "blocks": nblocks, "batch": args.batch, "reps": args.reps}
        for name, vals in got.items():
            if vals and name not in skipped:
                row[name] = {"write_GBps": statistics.median(v[0] for v in vals) / 1e9,
                             "read_GBps": statistics.median(v[1] for v in vals) / 1e9,
                             "samples": [[w / 1e9, r / 1e9] for w, r in vals]}
            else:
                row[name] = {"skipped": skipped.get(name, "no result")}
        row["kvstore_ratios"] = rep_ratios(by_rep, skipped)
        rows.append(row)
    return rows


def rep_ratios(by_rep: list[dict[str, tuple[float, float]]], skipped: dict[str, str]) -> dict:
    """kvstore / each other contender, write and read, per repetition (both measured in
    the same repetition, moments apart) and their medians: on a disk whose speed drifts
    by tens of percent between repetitions, these are steadier than ratios of medians."""
    out: dict = {}
    if "kvstore" in skipped:
        return out
    names = {n for rep in by_rep for n in rep} - {"kvstore"} - set(skipped)
    for name in sorted(names):
        pairs = [(rep["kvstore"], rep[name]) for rep in by_rep if "kvstore" in rep and name in rep]
        if not pairs:
            continue
        w = [kv[0] / other[0] for kv, other in pairs]
        r = [kv[1] / other[1] for kv, other in pairs]
        out[name] = {"write_median": statistics.median(w), "read_median": statistics.median(r),
                     "write": w, "read": r}
    return out


def bench_restart(base: str, entries: int) -> dict:
    """Open time of a tier whose index holds ``entries`` 4 KiB blocks (index only: the
    records point into a sparse data file, so no data is written)."""
    path = os.path.join(base, "restart")
    os.makedirs(path)
    block = 4096
    ext = extent_bytes(block)
    file_bytes = ext * entries
    with open(os.path.join(path, "data-00000.kvd"), "wb") as f:
        f.truncate(file_bytes)
    index = BlockIndex(path, sync=False)
    index.set_file_size(0, file_bytes)
    ns = Namespace(model="restart", dtype="u8", chunk_tokens=1)
    keys = ns.chunk_keys(np.arange(entries))
    t0 = time.time() - entries
    step = 50_000
    for s in range(0, entries, step):
        index.put((k.digest, Record(0, i * ext, block, 0, k.to_bytes()), t0 + i)
                  for i, k in enumerate(keys[s:s + step], start=s))
    index.sync()
    index.close()
    start = time.perf_counter()
    tier = NvmeTier(path, block * entries, file_bytes=file_bytes)
    recovered = tier.recover()
    elapsed = time.perf_counter() - start
    assert len(recovered) == entries and recovered[0].key == keys[0]
    tier.close()
    shutil.rmtree(path, ignore_errors=True)
    return {"entries": entries, "open_and_recover_s": elapsed}


def bench_fsck(base: str, block: int, nblocks: int) -> dict:
    path = os.path.join(base, "fsck")
    tier = NvmeTier(path, extent_bytes(block) * nblocks, file_bytes=1 << 30, io_threads=16)
    ns = Namespace(model="fsck", dtype="u8", chunk_tokens=1)
    keys = ns.chunk_keys(np.arange(nblocks))
    src = aligned_empty(block)
    src[:] = 7
    for i in range(0, nblocks, 64):
        tier.write(keys[i:i + 64], [src] * len(keys[i:i + 64]))
    tier.close()
    drop_page_cache([path])
    start = time.perf_counter()
    report = fsck(path, progress=False)
    elapsed = time.perf_counter() - start
    assert report.problems == 0 and report.verified == nblocks
    shutil.rmtree(path, ignore_errors=True)
    return {"blocks": nblocks, "block_bytes": block, "seconds": elapsed,
            "verified_GBps": report.verified_bytes / elapsed / 1e9}


def contender_names(row: dict) -> list[str]:
    return [k for k in row if isinstance(row[k], dict) and k != "kvstore_ratios"]


def print_table(rows: list[dict]) -> None:
    names = contender_names(rows[0])
    print(f"{'block':>8} | " + " | ".join(f"{n:>22}" for n in names) + " | kvstore/fio (w, r)")
    print(f"{'':>8} | " + " | ".join(f"{'write / read GB/s':>22}" for _ in names) + " |")
    for row in rows:
        cells = []
        for n in names:
            v = row[n]
            cells.append(f"{v['write_GBps']:>10.2f} / {v['read_GBps']:<9.2f}" if "write_GBps" in v
                         else f"{'skipped':>22}")
        kv, fio = row.get("kvstore", {}), row.get("fio", {})
        ratio = (f"{kv['write_GBps'] / fio['write_GBps']:.2f}, {kv['read_GBps'] / fio['read_GBps']:.2f}"
                 if "write_GBps" in kv and "write_GBps" in fio else "n/a")
        print(f"{row['block_bytes'] >> 10:>6}Ki | " + " | ".join(cells) + f" | {ratio}")
    print("kvstore / contender, medians of per-repetition ratios (write, read) and the read ratios:")
    for row in rows:
        for n, v in row.get("kvstore_ratios", {}).items():
            reads = " ".join(f"{x:.2f}" for x in v["read"])
            print(f"{row['block_bytes'] >> 10:>6}Ki | {n:>18}: {v['write_median']:.2f}, {v['read_median']:.2f}"
                  f"  (reads: {reads})")
    for row in rows:
        for n in names:
            if "skipped" in row[n]:
                print(f"  {n} skipped at {row['block_bytes'] >> 10} KiB: {row[n]['skipped']}")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = contender_names(rows[0])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, op in zip(axes, ("write", "read")):
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            vals = [r[n].get(f"{op}_GBps", 0.0) for r in rows]
            ax.bar([x + i * width for x in range(len(rows))], vals, width, label=n)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
        ax.set_xticklabels([f"{r['block_bytes'] >> 10} KiB" for r in rows])
        ax.set_title(f"{op} (batches of {rows[0]['batch']}, cold reads)")
        ax.set_ylabel("GB/s")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="directory on the drive under test (default: a temp dir in /var/tmp)")
    parser.add_argument("--sizes", default="256KiB,1MiB,4MiB")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--bytes", type=parse_size, default="512MiB", help="bytes per measurement")
    parser.add_argument("--reps", type=int, default=9,
                        help="repetitions per size (the disk here varies by ±15%% between them)")
    parser.add_argument("--lmcache-python", default=os.environ.get("LMCACHE_PYTHON"),
                        help="a Python with lmcache==0.5.6 installed")
    parser.add_argument("--skip-lmcache", action="store_true")
    parser.add_argument("--index-entries", type=int, default=1_000_000)
    parser.add_argument("--contenders", type=lambda t: t.split(","),
                        help="comma list of columns to run (default all), e.g. kvstore,lmcache-fs-native")
    parser.add_argument("--skip-extras", action="store_true", help="skip the restart and fsck timings")
    parser.add_argument("--out", default=os.path.join(RESULTS, "nvme.json"),
                        help="JSON result path (the PNG goes beside it)")
    args = parser.parse_args()
    known = {"kvstore", "fio", "lmcache-disk", "lmcache-fs-native"}
    if args.contenders and not set(args.contenders) <= known:
        parser.error(f"--contenders: unknown {sorted(set(args.contenders) - known)}; known: {sorted(known)}")
    base = tempfile.mkdtemp(prefix="kvstore-nvme-bench-", dir=args.dir or "/var/tmp")
    try:
        rows = bench_sizes(args, base)
        restart = None if args.skip_extras else bench_restart(base, args.index_entries)
        check = None if args.skip_extras else bench_fsck(base, 1 << 20, 512)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_table(rows)
    if restart:
        print(f"restart: open + recover of {restart['entries']:,} index entries: {restart['open_and_recover_s']:.2f} s")
    if check:
        print(f"fsck: {check['blocks']} x {check['block_bytes'] >> 20} MiB verified at {check['verified_GBps']:.2f} GB/s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    out = {"throughput": rows, "restart": restart, "fsck": check, "argv": sys.argv[1:]}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    plot(rows, os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
