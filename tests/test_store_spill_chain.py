"""Spills through several tiers that cannot lend views (NVMe here; Redis, S3, Mooncake
the same): moving a block down through a scratch buffer may evict from a full tier
below, whose victim moves further down through a scratch buffer too. Each level of
that cascade has its own buffer, so no block is stored with another block's bytes."""

import numpy as np
import pytest

from kvstore.config import load_config
from kvstore.store import Store, copies
from kvstore.store.build import build_tier
from kvstore.testing import make_keys
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier

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


def test_a_batched_cascade_keeps_every_block_its_own_bytes(tmp_path):
    """A whole batch moves through one scratch buffer per level: each level's group is
    read into slices of its own buffer while the put below evicts and spills again."""
    cfg = {"tiers": [{"name": "hot", "kind": "dram", "capacity": 4 * BLOCK, "pin": False},
                     _nvme("n1", tmp_path / "n1", 4), _nvme("n2", tmp_path / "n2", 4),
                     _nvme("n3", tmp_path / "n3", 32)]}
    rounds = [make_keys(4, salt=f"batched-cascade-{r}") for r in range(5)]
    srcs = {key: np.full(BLOCK, 4 * r + i + 1, np.uint8) for r, keys in enumerate(rounds) for i, key in enumerate(keys)}
    with Store.from_config(cfg) as store:
        for keys in rounds:   # each save pushes the rounds before it one tier further down
            assert store.save(keys, [srcs[k] for k in keys]).result() == [True] * 4
        tiers = store.stats()["tiers"]
        assert tiers[1]["spills"] >= 4 and tiers[2]["spills"] >= 4
        for keys in rounds:
            dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
            assert store.load(keys, dsts).result() == [True] * 4
            for key, dst in zip(keys, dsts):
                assert np.array_equal(dst, srcs[key]), f"block {srcs[key][0]} came back holding {dst[0]}'s bytes"


class _CountingNvme(NvmeTier):
    """A real NVMe tier that records the size of each batch it is asked to move."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.writes: list[int] = []
        self.reads: list[int] = []

    def write(self, keys, srcs, checksums=None):
        self.writes.append(len(keys))
        return super().write(keys, srcs, checksums)

    def read_into(self, keys, dsts):
        self.reads.append(len(keys))
        return super().read_into(keys, dsts)


def _dram_over_counting_nvme(tmp_path, blocks: int):
    cfg = load_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": blocks * BLOCK, "pin": False},
                                 _nvme("warm", tmp_path / "warm", 64)]})
    nvme = _CountingNvme(str(tmp_path / "warm"), 64 * BLOCK, name="warm", direct_io=False, file_bytes=1 << 20)
    return Store(cfg, tiers=[DramTier(blocks * BLOCK, name="hot", pin=False), nvme]), nvme


@pytest.mark.parametrize("batch_blocks", [None, 3])
def test_spills_and_prefetches_move_in_batches(tmp_path, monkeypatch, batch_blocks):
    """A spill of 8 victims is one write below, a prefetch of 8 blocks one read (or runs of
    at most MOVE_BATCH_BYTES when that is smaller), and every block keeps its bytes."""
    if batch_blocks is not None:
        monkeypatch.setattr(copies, "MOVE_BATCH_BYTES", batch_blocks * BLOCK)
    first, second = make_keys(8, salt="batched-a"), make_keys(8, salt="batched-b")
    srcs = [np.full(BLOCK, i + 1, np.uint8) for i in range(8)]
    store, nvme = _dram_over_counting_nvme(tmp_path, 8)
    with store:
        assert store.save(first, srcs).result() == [True] * 8
        assert nvme.writes == []
        assert store.save(second, srcs).result() == [True] * 8   # all of `first` spills
        runs = [8] if batch_blocks is None else [3, 3, 2]
        assert nvme.writes == runs
        assert store.stats()["tiers"][0]["spills"] == 8
        assert store.prefetch(first).result() == 8   # evicts `second` (spilled: written below)
        assert nvme.reads == runs
        for keys in (first, second):
            dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
            assert store.load(keys, dsts).result() == [True] * 8
            assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))


class _LendCounting(DramTier):
    """A real DRAM tier that counts the blocks it copies out through read_into (what a
    move through scratch does; a borrowed view copies nothing here)."""
    copied_out = 0

    def read_into(self, keys, dsts):
        self.copied_out += len(keys)
        return super().read_into(keys, dsts)


@pytest.mark.parametrize("dram_room", [False, True])
@pytest.mark.parametrize("top", ["gpu", "dram"])
def test_a_prefetch_up_from_dram_keeps_every_block(tmp_path, top, dram_room):
    """A prefetch into the level above DRAM evicts that level, whose victims spill back
    into DRAM. With DRAM full, DRAM must evict for them, so the prefetch holds no DRAM
    views meanwhile (a lent slot stays taken: evicting it frees nothing); with room in
    DRAM it borrows them (zero-copy). Either way no block is lost or changed."""
    first = {"name": "top", "kind": "gpu", "device": "cpu", "capacity": 4 * BLOCK} if top == "gpu" else \
        {"name": "top", "kind": "dram", "capacity": 4 * BLOCK, "pin": False}
    dram_blocks = 12 if dram_room else 4   # with room: rounds 0 and 1 in DRAM, 4 blocks free
    cfg = load_config({"tiers": [first, {"name": "hot", "kind": "dram", "capacity": dram_blocks * BLOCK, "pin": False},
                                 _nvme("n", tmp_path / "n", 64)]})
    tiers = [build_tier(cfg.tiers[0]), _LendCounting(dram_blocks * BLOCK, name="hot", pin=False),
             build_tier(cfg.tiers[2])]
    rounds = [make_keys(4, salt=f"up-{r}") for r in range(3)]
    srcs = {k: np.full(BLOCK, 10 * r + i + 1, np.uint8) for r, keys in enumerate(rounds) for i, k in enumerate(keys)}
    with Store(cfg, tiers=tiers) as store:
        for keys in rounds:
            assert store.save(keys, [srcs[k] for k in keys]).result() == [True] * 4
        tiers[1].copied_out = 0
        assert store.prefetch(rounds[1], 0).result() == 4   # round 1 is in DRAM; round 2 leaves the top
        assert store.stats()["tiers"][1]["full"] == 0
        assert tiers[1].copied_out == (0 if dram_room else 4), "borrowed DRAM's views with DRAM full, or not with room"
        for keys in rounds:
            dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
            assert store.load(keys, dsts).result() == [True] * 4, "a prefetch lost blocks"
            for key, dst in zip(keys, dsts):
                assert np.array_equal(dst, srcs[key])


def test_a_spill_that_raises_strands_no_victim_in_the_tier_above(tmp_path):
    """Victims leave the index before they move: if the move raises, they still leave the
    tier above, so its room stays the index's (the next save fits)."""
    class FailingOnce(NvmeTier):
        failed = False

        def write(self, keys, srcs, checksums=None):
            if not FailingOnce.failed:
                FailingOnce.failed = True
                raise RuntimeError("injected: a bug below, not a tier error")
            return super().write(keys, srcs, checksums)

    cfg = load_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": 8 * BLOCK, "pin": False},
                                 _nvme("warm", tmp_path / "warm", 64)]})
    nvme = FailingOnce(str(tmp_path / "warm"), 64 * BLOCK, name="warm", direct_io=False, file_bytes=1 << 20)
    rounds = [make_keys(8, salt=f"raise-{r}") for r in range(3)]
    srcs = [np.full(BLOCK, i + 1, np.uint8) for i in range(8)]
    with Store(cfg, tiers=[DramTier(8 * BLOCK, name="hot", pin=False), nvme]) as store:
        assert store.save(rounds[0], srcs).result() == [True] * 8
        with pytest.raises(RuntimeError, match="injected"):
            store.save(rounds[1], srcs).result()
        assert store.tiers[0].contains(rounds[0]) == [False] * 8, "victims stranded in the tier above"
        assert store.save(rounds[2], srcs).result() == [True] * 8
        dsts = [np.zeros(BLOCK, np.uint8) for _ in srcs]
        assert store.load(rounds[2], dsts).result() == [True] * 8
        assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
