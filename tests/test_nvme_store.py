"""A two-tier Store, DRAM over NVMe: spill, promotion, leases, restart, corruption."""

import os

import numpy as np
import pytest

from kvstore.config import DEFAULT_CONFIG, load_config
from kvstore.store import Store
from kvstore.testing import make_keys, payload
from kvstore.tiers.nvme.io import PAGE

BLOCK = 64 * 1024


def config(path, *, hot=4, warm=16, **nvme):
    return {"tiers": [
        {"name": "hot", "kind": "dram", "capacity": hot * BLOCK},
        {"name": "warm", "kind": "nvme", "path": path, "capacity": warm * BLOCK,
         "file_bytes": "1MiB", "io_threads": 4, **nvme},
    ]}


def save_one_by_one(store, keys, first=0):
    """Separate saves, so the DRAM tier evicts (and spills) its oldest blocks."""
    for i, key in enumerate(keys):
        assert store.save([key], [payload(first + i)]).result() == [True]


def load(store, keys, idx):
    dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
    ok = store.load(keys, dsts).result()
    for good, dst, i in zip(ok, dsts, idx):
        assert not good or np.array_equal(dst, payload(i)), "wrong bytes"
    return ok


def test_spill_and_promotion(tmp_path):
    with Store.from_config(config(str(tmp_path / "n"))) as store:
        keys = make_keys(10)
        save_one_by_one(store, keys)
        hot, warm = store.tiers
        assert hot.used_bytes == 4 * BLOCK
        assert warm.contains(keys[:6]) == [True] * 6      # the first six were spilled
        st = store.stats()["tiers"]
        assert st[0]["spills"] == 6 and st[1]["writes"] == 6 and st[1]["io_mode"] in ("direct", "buffered")
        assert hot.contains(keys[:1]) == [False]
        assert load(store, keys[:1], [0]) == [True]            # a hit in NVMe is promoted
        assert store.stats()["tiers"][0]["promotions"] == 1
        assert hot.contains(keys[:1]) == [True] and store.stats()["tiers"][1]["hits"] == 1
        assert load(store, keys, range(10)) == [True] * 10


def test_leases_hold_across_tiers(tmp_path):
    with Store.from_config(config(str(tmp_path / "n"), warm=8)) as store:
        keys = make_keys(8)
        save_one_by_one(store, keys)
        leased = keys[:4]                                  # these now live in NVMe only
        assert store.tiers[1].contains(leased) == [True] * 4
        assert store.lookup(leased, lease_s=60) == 4
        more = make_keys(24, salt="more")
        save_one_by_one(store, more, 100)
        assert store.contains(leased) == [True] * 4       # never evicted while leased
        assert load(store, leased, range(4)) == [True] * 4


def test_restart_recovers_nvme_blocks(tmp_path):
    cfg = config(str(tmp_path / "n"))
    keys = make_keys(12)
    with Store.from_config(cfg) as store:
        save_one_by_one(store, keys)
        on_disk = [k for k, held in zip(keys, store.tiers[1].contains(keys)) if held]
        used = store.tiers[1].used_bytes
    assert on_disk
    with Store.from_config(cfg) as store:
        assert store.tiers[1].used_bytes == used
        assert store.contains(on_disk) == [True] * len(on_disk)
        idx = [keys.index(k) for k in on_disk]
        assert load(store, on_disk, idx) == [True] * len(on_disk)
        assert store.stats()["tiers"][1]["blocks"] == len(on_disk)


def test_corrupt_nvme_copy_is_a_counted_miss(tmp_path):
    path = str(tmp_path / "n")
    with Store.from_config(config(path)) as store:
        keys = make_keys(6)
        save_one_by_one(store, keys)
        warm = store.tiers[1]
        victim = keys[0]
        e = warm._entries[victim]
        with open(os.path.join(path, f"data-{e.file_no:05d}.kvd"), "r+b") as f:
            f.seek(e.offset + PAGE + 10)
            f.write(b"\xde\xad")
        assert load(store, [victim], [0]) == [False]
        assert store.contains([victim]) == [False]
        assert store.stats()["tiers"][1]["corruptions"] == 1
        assert load(store, keys[1:], range(1, 6)) == [True] * 5


def test_default_config_has_a_lazy_nvme_tier(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(DEFAULT_CONFIG)
    assert [t.kind for t in cfg.tiers] == ["dram", "nvme"]
    small = cfg.model_copy(update={"tiers": [cfg.tiers[0].model_copy(update={"capacity": 1 << 20}),
                                             cfg.tiers[1]]})
    with Store(small) as store:
        st = store.stats()["tiers"][1]
        assert st["capacity_bytes"] == 8 << 30 and st["file_bytes"] == 0   # nothing preallocated yet
    assert os.path.isdir(tmp_path / "kvstore-data" / "index")


def test_nvme_config_errors(tmp_path):
    from kvstore.errors import ConfigError

    with pytest.raises(ConfigError, match="path"):
        load_config({"tiers": [{"name": "w", "kind": "nvme", "path": [], "capacity": "1MiB"}]})
    with pytest.raises(ConfigError, match="file_bytes"):
        load_config({"tiers": [{"name": "w", "kind": "nvme", "path": "x", "capacity": "1MiB",
                                "file_bytes": 0}]})


def test_eviction_order_survives_a_restart(tmp_path):
    """LRU over a restart: the blocks read last before closing are the last to go after."""
    cfg = {"tiers": [{"name": "warm", "kind": "nvme", "path": str(tmp_path / "n"),
                      "capacity": 6 * BLOCK, "file_bytes": "1MiB", "eviction": "lru"}]}
    keys = make_keys(6)
    with Store.from_config(cfg) as store:
        save_one_by_one(store, keys)
        assert load(store, [keys[1]], [1]) == [True]
        assert load(store, [keys[0]], [0]) == [True]
    with Store.from_config(cfg) as store:
        assert store.stats()["tiers"][0]["used_bytes"] == 6 * BLOCK
        save_one_by_one(store, make_keys(3, salt="new"), 50)
        # oldest access first: 2, 3, 4 go; 5, 1, 0 (read last) stay
        assert store.contains(keys) == [True, True, False, False, False, True]
