"""Store methods the cache server relies on: borrow (zero-copy views held as leases)
and flush (volatile blocks written down to a persistent tier at shutdown)."""

from __future__ import annotations

import numpy as np

from kvstore.config import load_config
from kvstore.store import Store
from kvstore.testing import make_keys, payload
from kvstore.tiers.base import TierCapabilities
from kvstore.tiers.dram import DramTier

BLOCK = 64 * 1024


def _store(tiers_cfg, tiers=None):
    return Store(load_config({"tiers": tiers_cfg}, env={}), tiers=tiers)


def test_borrow_views_are_hits_and_hold_their_slots():
    with _store([{"name": "hot", "kind": "dram", "capacity": "1MiB", "pin": False}]) as store:
        keys = make_keys(3)
        assert all(store.save(keys[:2], [payload(0, BLOCK), payload(1, BLOCK)]).result())
        store.lookup(keys[:2], lease_s=60)
        with store.borrow(keys) as views:
            assert views[2] is None
            assert np.array_equal(views[0], payload(0, BLOCK))
            assert not views[0].flags.writeable
            assert store.stats()["leases"] == 0  # a borrow is a read: leases end
            store.delete(keys[:1])
            # the deleted block's slot is not reused while borrowed
            store.save(make_keys(8, salt="x"), [np.zeros(BLOCK, np.uint8)] * 8).result()
            assert np.array_equal(views[0], payload(0, BLOCK))
        assert store.stats()["tiers"][0]["hits"] == 2


class _PersistentDram(DramTier):
    """A DRAM tier that calls itself persistent: stands in for NVMe so flush can be
    checked in a build without the NVMe tier."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.capabilities = TierCapabilities(device="cpu", persistent=True, alignment=4096)


def test_flush_writes_volatile_blocks_down():
    cfg = [{"name": "hot", "kind": "dram", "capacity": "1MiB", "pin": False},
           {"name": "disk", "kind": "dram", "capacity": "4MiB", "pin": False}]
    tiers = [DramTier(1 << 20, name="hot", pin=False), _PersistentDram(4 << 20, name="disk", pin=False)]
    with _store(cfg, tiers) as store:
        keys = make_keys(4)
        assert all(store.save(keys, [payload(i, BLOCK) for i in range(4)]).result())
        assert tiers[1].contains(keys) == [False] * 4
        assert store.flush() == 4
        assert tiers[1].contains(keys) == [True] * 4
        assert store.flush() == 0
        dst = np.zeros(BLOCK, np.uint8)
        assert tiers[1].read_into(keys[2:3], [dst]) == [True] and np.array_equal(dst, payload(2, BLOCK))
