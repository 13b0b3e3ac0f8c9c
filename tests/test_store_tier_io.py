"""The Store's data path (kvstore.store.datapath) over tiers that fail, through the mover's
one tier-failure boundary (``Mover.tier_io``): a tier error or ``OSError`` is a counted,
logged miss and the block stays indexed; a caller's wrong-sized buffer still raises.
Whatever fails, a load reports True only for the exact bytes saved (never wrong KV)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import Store
from kvstore.errors import BufferSizeError, TierIOError, TierUnavailableError
from kvstore.testing import make_keys, payload

BLOCK = 64 * 1024


def _store(levels: int = 1) -> Store:
    tiers = [{"name": f"t{i}", "kind": "dram", "capacity": 16 * BLOCK, "pin": False} for i in range(levels)]
    return Store.from_config({"tiers": tiers})


def _load(store: Store, keys) -> tuple[list[bool], list[np.ndarray]]:
    dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
    return store.load(keys, dsts).result(), dsts


@pytest.mark.parametrize("error", [TierIOError("disk gone"), TierUnavailableError("endpoint down"),
                                   OSError("EIO")], ids=["tier-io", "unavailable", "os"])
def test_a_failing_read_is_a_counted_miss_and_the_block_loads_once_the_tier_is_back(monkeypatch, error):
    keys, srcs = make_keys(3, salt=f"read-{type(error).__name__}"), [payload(i, BLOCK) for i in range(3)]
    with _store() as store:
        assert store.save(keys, srcs).result() == [True] * 3
        tier = store.tiers[0]

        def broken(*args):
            raise error

        monkeypatch.setattr(tier, "read_into", broken)
        ok, dsts = _load(store, keys)
        assert ok == [False] * 3 and not any(d.any() for d in dsts)
        stats = store.stats()["tiers"][0]
        assert stats["errors"] == 1 and stats["misses"] == 3
        assert store.contains(keys) == [True] * 3           # still indexed: the tier may come back
        monkeypatch.undo()
        ok, dsts = _load(store, keys)
        assert ok == [True] * 3 and all(np.array_equal(d, s) for d, s in zip(dsts, srcs))


def test_a_buffer_size_error_from_a_tier_reaches_the_caller(monkeypatch):
    keys = make_keys(1, salt="buffer-size")
    with _store() as store:
        assert store.save(keys, [payload(0, BLOCK)]).result() == [True]

        def wrong_size(*args):
            raise BufferSizeError("buffer has 1 bytes, block has 65536")

        monkeypatch.setattr(store.tiers[0], "read_into", wrong_size)
        with pytest.raises(BufferSizeError):
            store.load(keys, [np.zeros(BLOCK, np.uint8)]).result()
        assert store.stats()["tiers"][0]["errors"] == 0      # the caller's buffer, not a tier failure


def test_a_failing_write_stores_below_and_loads_exact_bytes(monkeypatch):
    keys, srcs = make_keys(4, salt="write-fails"), [payload(10 + i, BLOCK) for i in range(4)]
    with _store(levels=2) as store:
        def broken(*args):
            raise TierIOError("no room after all")

        monkeypatch.setattr(store.tiers[0], "write", broken)
        assert store.save(keys, srcs).result() == [True] * 4    # the next tier took them
        monkeypatch.undo()
        stats = store.stats()["tiers"]
        assert stats[0]["errors"] >= 1 and stats[0]["blocks"] == 0 and stats[1]["blocks"] == 4
        ok, dsts = _load(store, keys)
        assert ok == [True] * 4 and all(np.array_equal(d, s) for d, s in zip(dsts, srcs))


def test_a_resave_with_other_bytes_never_changes_what_a_load_returns():
    # same key, same content: the data path touches a held key, never rewrites it
    keys, srcs = make_keys(2, salt="resave"), [payload(i, BLOCK) for i in range(2)]
    with _store() as store:
        assert store.save(keys, srcs).result() == [True, True]
        assert store.save(keys, [payload(99, BLOCK)] * 2).result() == [True, True]
        ok, dsts = _load(store, keys)
        assert ok == [True, True] and all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
        assert store.stats()["saves"] == 4


def test_a_failing_delete_is_counted_and_the_keys_leave_the_index(monkeypatch):
    keys = make_keys(2, salt="delete-fails")
    with _store() as store:
        assert store.save(keys, [payload(i, BLOCK) for i in range(2)]).result() == [True, True]

        def broken(*args):
            raise OSError("EIO")

        monkeypatch.setattr(store.tiers[0], "delete", broken)
        assert store.delete(keys) == 2
        assert store.contains(keys) == [False, False] and store.stats()["tiers"][0]["errors"] == 1
