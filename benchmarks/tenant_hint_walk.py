"""What the tenants' bound on retention hints costs the eviction walk.

    python -m benchmarks.tenant_hint_walk

As ``benchmarks.hint_walk`` (8,192 distinct 4 KiB blocks, 16 per call, into a one-tier
LRU DRAM Store of 1,024 blocks; every other call hinted ``Hint(retain_s=1e6)``, so
the hinted blocks pile up at the eviction end), all blocks one tenant's, with:

- ``no tenants``: no ledger (an embedded Store; the baseline, same run);
- ``within quota``: a ledger, the tenant's quota 1,023 blocks: each walk checks once
  that every tenant holding blocks is within a quota, then walks as without tenants;
- ``+ a no-quota block``: the same, plus one pinned block of a key that is nobody's,
  so each walk looks every hinted key it steps over in the queue up in the set of
  unbound keys (the parked ones once, when the ledger is attached);
- ``no quota``: the tenant has none: its hints protect nothing, plain LRU walks.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks._common import print_table, write_json
from kvstore import Hint, Namespace, Store
from kvstore.net.server._tenants import Tenant
from kvstore.store.tenants import TenantLedger

BLOCKS, CAPACITY, BATCH, NBYTES, REPEATS = 8192, 1024, 16, 4096, 5
MODES = ("no tenants", "within quota", "+ a no-quota block", "no quota")


def saves_per_s(mode: str, keys: list, buf: np.ndarray, tenant: Tenant) -> float:
    config = {"tiers": [{"name": "t", "kind": "dram", "capacity": CAPACITY * NBYTES, "eviction": "lru"}],
              "io_threads": 1}
    with Store.from_config(config) as store:
        if mode != "no tenants":
            quota = {} if mode == "no quota" else {0: (CAPACITY - 1) * NBYTES}
            store.set_tenants(TenantLedger({tenant.tag: "a"}, {"a": quota}, ["t"]))
        if mode == "+ a no-quota block":
            other = Namespace(model="nobody", dtype="u8", chunk_tokens=1).chunk_keys([0])
            store.save(other, [buf]).result()
            store.pin(other)
        t0 = time.perf_counter()
        for lo in range(0, BLOCKS, BATCH):
            hint = Hint(1e6) if (lo // BATCH) % 2 == 0 else None
            store.save(keys[lo:lo + BATCH], [buf] * BATCH, hint=hint).result()
        return BLOCKS / (time.perf_counter() - t0)


def main() -> None:
    tenant = Tenant("a", "token", "salt-of-tenant-a-0001")
    keys = tenant.keys(Namespace(model="bench", dtype="u8", chunk_tokens=1).chunk_keys(np.arange(BLOCKS)),
                       cached=False)
    buf = np.zeros(NBYTES, np.uint8)
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(REPEATS):        # interleaved, so a noisy moment hits every mode alike
        for mode in MODES:
            runs[mode].append(saves_per_s(mode, keys, buf, tenant))
    medians = {mode: float(np.median(rates)) for mode, rates in runs.items()}
    base = medians["no tenants"]
    print_table(["mode", "saves/s (median)", "vs no tenants"],
                [[mode, f"{rate:,.0f}", f"{rate / base:.2f}x"] for mode, rate in medians.items()])
    write_json("tenant_hint_walk", {"blocks": BLOCKS, "capacity_blocks": CAPACITY, "batch": BATCH, "nbytes": NBYTES,
                                    "repeats": REPEATS, "runs": runs, "medians": medians,
                                    "command": "python -m benchmarks.tenant_hint_walk"})


if __name__ == "__main__":
    main()
