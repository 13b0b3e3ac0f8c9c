"""Spills through several tiers that cannot lend views (NVMe here; Redis, S3, Mooncake
the same): moving a block down through a scratch buffer may evict from a full tier
below, whose victim moves further down through a scratch buffer too. Each level of
that cascade has its own buffer, so no block is stored with another block's bytes."""

import numpy as np

from kvstore.store import Store
from kvstore.testing import make_keys

BLOCK = 64 * 1024


def _nvme(name, path, blocks):
    return {"name": name, "kind": "nvme", "path": str(path), "capacity": blocks * BLOCK, "direct_io": False,
            "file_bytes": "1MiB"}


def test_a_cascade_of_spills_keeps_every_block_its_own_bytes(tmp_path):
    cfg = {"tiers": [{"name": "hot", "kind": "dram", "capacity": BLOCK, "pin": False},
                     _nvme("n1", tmp_path / "n1", 1), _nvme("n2", tmp_path / "n2", 1),
                     _nvme("n3", tmp_path / "n3", 16)]}
    keys = make_keys(6, salt="cascade")
    srcs = [np.full(BLOCK, i + 1, np.uint8) for i in range(6)]
    with Store.from_config(cfg) as store:
        for key, src in zip(keys, srcs):   # one at a time: each save pushes the others one tier down
            assert store.save([key], [src]).result() == [True]
        tiers = store.stats()["tiers"]
        assert tiers[1]["spills"] >= 3 and tiers[2]["spills"] >= 2   # n1 -> n2 -> n3 moved through scratch
        for key, src in zip(keys, srcs):
            dst = np.zeros(BLOCK, np.uint8)
            assert store.load([key], [dst]).result() == [True]
            assert np.array_equal(dst, src), f"block {src[0]} came back holding block {dst[0]}'s bytes"
