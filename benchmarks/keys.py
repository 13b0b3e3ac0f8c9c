"""Key hashing and lookup cost.

    python -m benchmarks.keys

Hashes a 128K-token prompt into chunk keys (256 tokens per chunk, the default chunk size
of the connectors; also 16 and 64) and looks up 1,000 keys in a Store holding them, side
by side with the baseline of a plain dict membership loop over the same keys.
Targets: hashing <= 5 ms at 256 tokens/chunk; lookup of 1,000 keys <= 1 ms.
"""

from __future__ import annotations

import numpy as np

from benchmarks._common import median_time, print_table, write_json
from kvstore.keys import Namespace
from kvstore.store import Store

PROMPT_TOKENS = 128 * 1024


def main() -> None:
    tokens = np.random.default_rng(0).integers(0, 128_000, PROMPT_TOKENS, dtype=np.int64)
    rows, hashing = [], []
    for chunk in (16, 64, 256):
        ns = Namespace(model="bench", dtype="bf16", chunk_tokens=chunk)
        ms = median_time(lambda: ns.chunk_keys(tokens), repeat=11) * 1e3
        hashing.append({"chunk_tokens": chunk, "keys": PROMPT_TOKENS // chunk, "ms": ms})
        rows.append([f"hash 128K tokens, {chunk}/chunk", PROMPT_TOKENS // chunk, ms,
                     "<= 5" if chunk == 256 else "-"])

    ns = Namespace(model="bench", dtype="bf16", chunk_tokens=1)
    keys = ns.chunk_keys(np.arange(1000))
    with Store.from_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": "64MiB"}]}) as store:
        store.save(keys, [np.zeros(4096, np.uint8)] * len(keys)).result()
        plain = set(keys)
        lookup_ms = median_time(lambda: store.lookup(keys), repeat=51) * 1e3
        lease_ms = median_time(lambda: store.lookup(keys, lease_s=5), repeat=51) * 1e3
        base_ms = median_time(lambda: sum(1 for k in keys if k in plain), repeat=51) * 1e3
        assert store.lookup(keys) == 1000
    rows += [["lookup 1000 keys", 1000, lookup_ms, "<= 1"],
             ["lookup 1000 keys + lease", 1000, lease_ms, "<= 1"],
             ["baseline: set membership loop", 1000, base_ms, "-"]]
    print_table(["operation", "keys", "ms", "target ms"], rows)
    path = write_json("keys", {"hashing": hashing, "lookup_ms": lookup_ms, "lookup_lease_ms": lease_ms,
                               "baseline_membership_ms": base_ms})
    print("wrote", path)


if __name__ == "__main__":
    main()
