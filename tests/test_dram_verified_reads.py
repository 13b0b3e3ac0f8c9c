"""Issue 20, finding 6 follow-ups: every read of a DRAM slot is verified before its bytes
are used or reported. A borrow (the embedded vLLM load path) of a corrupt slot is a
miss that drops it; the write-through of a reservation never copies a corrupt slot
down; and a block moving from DRAM into NVMe or S3 keeps the checksum DRAM stored it
with, so bytes changed after that check fail their first read below instead of being
re-hashed into a "good" copy."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstore import Store
from kvstore.block import EXT_HEADER_BYTES, checksum, parse_block_header
from kvstore.config import load_config
from kvstore.errors import InvalidArgumentError
from kvstore.testing import make_keys, payload
from kvstore.tiers.s3.stage import Staging
from kvstore.tiers.nvme import NvmeTier

from tests._stray_dram import StrayWriteDram

BLOCK = 64 * 1024


def _store(tiers: list[dict], **extra) -> Store:
    return Store.from_config({"tiers": tiers, **extra})


def _dram(capacity: int = 8 * BLOCK) -> dict:
    return {"name": "hot", "kind": "dram", "capacity": capacity, "pin": False}


def _flip(store: Store, key, at: int = 7) -> None:
    dram = store.tiers[0]
    offset, _ = dram.offset_of(key)
    dram.arena[offset + at] ^= 0x20          # memory error / stray write through a shared mapping


@pytest.mark.parametrize("offsets", [False, True], ids=["views", "offsets"])
def test_a_borrow_of_a_corrupt_slot_is_a_miss_and_drops_it(offsets):
    keys = make_keys(3, salt=f"borrow-{offsets}")
    srcs = [payload(i, BLOCK) for i in range(3)]
    with _store([_dram()]) as store:
        assert store.save(keys, srcs).result() == [True] * 3
        _flip(store, keys[1])
        with store.borrow(keys, offsets=offsets) as got:
            assert got[1] is None
            assert got[0] is not None and got[2] is not None
            if not offsets:
                assert np.array_equal(got[0], srcs[0]) and np.array_equal(got[2], srcs[2])
        assert store.contains(keys) == [True, False, True]
        assert store.tiers[0].contains(keys) == [True, False, True]
        assert store.stats()["tiers"][0]["corruptions"] == 1
        assert store.lookup(keys) == 1


def test_borrow_without_verify_is_for_readers_that_check_the_sent_checksums():
    keys = make_keys(1, salt="borrow-unverified")
    src = payload(3, BLOCK)
    with _store([_dram()]) as store:
        store.save(keys, [src]).result()
        _flip(store, keys[0])
        with store.borrow(keys, verify=False) as got:
            assert got[0] is not None
            # what the cache server sends along: the reader's check fails
            assert checksum(got[0]) != store.checksums(keys)[0]


def test_write_through_of_a_reservation_never_copies_a_corrupt_slot_down(tmp_path):
    keys = make_keys(2, salt="write-below")
    srcs = [payload(10 + i, BLOCK) for i in range(2)]
    tiers = [_dram(), {"name": "warm", "kind": "nvme", "path": str(tmp_path / "nvme"), "capacity": "4MiB"}]
    with _store(tiers, placement={"write": "through"}, io_threads=1) as store:
        gate = threading.Event()
        store._pool.submit(gate.wait)          # holds the write-through queued behind it
        with store.reserve(keys, [BLOCK, BLOCK]) as res:
            for view, src in zip(res.views, srcs):
                view[:] = src
        _flip(store, keys[0])                  # after the commit hashed it, before the write-through
        gate.set()
        store._pool.submit(lambda: None).result()
        nvme = store.tiers[1]
        assert nvme.contains(keys) == [False, True]
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert store.load(keys, dsts).result() == [False, True]
        assert np.array_equal(dsts[1], srcs[1])
        assert store.stats()["tiers"][0]["corruptions"] == 1
        assert store.stats()["background_errors"] == 0


def test_a_spill_keeps_drams_checksum_so_bytes_changed_after_its_check_fail_below(tmp_path):
    keys = make_keys(4, salt="spill-sum")
    srcs = [payload(20 + i, BLOCK) for i in range(4)]
    nvme_dir = str(tmp_path / "nvme")
    cfg = load_config({"tiers": [_dram(2 * BLOCK), {"name": "warm", "kind": "nvme", "path": nvme_dir,
                                                    "capacity": "4MiB"}]})
    tiers = [StrayWriteDram(2 * BLOCK, name="hot", pin=False), NvmeTier(nvme_dir, 4 << 20, name="warm")]
    with Store(cfg, tiers=tiers) as store:
        assert store.save(keys[:2], srcs[:2]).result() == [True] * 2
        assert store.save(keys[2:], srcs[2:]).result() == [True] * 2   # the first two spill to NVMe
        assert store.tiers[1].contains(keys[:2]) == [True, True]
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        got = store.load(keys, dsts).result()
        # the spilled copies carry DRAM's checksum of the bytes before the stray write
        assert got[:2] == [False, False]
        assert got[2:] == [True, True]
        assert all(np.array_equal(dsts[i], srcs[i]) for i in (2, 3))


def test_nvme_keeps_a_given_checksum_of_its_own_kind_only(tmp_path):
    keys = make_keys(3, salt="nvme-given")
    srcs = [payload(30 + i, BLOCK) for i in range(3)]
    plain = NvmeTier(str(tmp_path / "plain"), 4 << 20)
    segmented = NvmeTier(str(tmp_path / "seg"), 4 << 20, device_verify=True)
    try:
        assert plain.capabilities.write_checksums and not segmented.capabilities.write_checksums
        given = [checksum(srcs[0]), checksum(srcs[1]) ^ 1, None]   # right, wrong, hash it here
        assert plain.write(keys, srcs, given) == [True] * 3
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert plain.read_into(keys, dsts) == [True, False, True]
        assert np.array_equal(dsts[0], srcs[0]) and np.array_equal(dsts[2], srcs[2])
        # a segmented tier hashes its own kind whatever it is handed
        assert segmented.write(keys, srcs, [c ^ 1 if c else c for c in given]) == [True] * 3
        assert segmented.read_into(keys, dsts) == [True] * 3
        assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
    finally:
        plain.close()
        segmented.close()


def test_an_s3_object_header_carries_the_given_checksum():
    key = make_keys(1, salt="s3-given")[0]
    src = payload(40, BLOCK)
    stage = Staging(part_size=8 << 20, multipart_threshold=16 << 20)
    for given in (None, checksum(src) ^ 1):
        pieces = stage.stage(key, src, BLOCK, given)
        head = parse_block_header(bytes(pieces[0][:EXT_HEADER_BYTES]), digest=key.digest)
        assert head.checksum == (checksum(src) if given is None else given)


def test_store_save_checks_each_given_checksum_and_hashes_where_none_is_given():
    keys = make_keys(3, salt="store-given")
    srcs = [payload(70 + i, BLOCK) for i in range(3)]
    with _store([_dram()]) as store:
        with pytest.raises(InvalidArgumentError, match="3 keys but 2 checksums"):
            store.save(keys, srcs, checksums=[None, None])
        assert store.save(keys, srcs, checksums=[checksum(srcs[0]), None, checksum(srcs[2]) ^ 1]).result() == \
            [True, True, False]
        assert store.stats()["refused_checksum"] == 1
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert store.load(keys, dsts).result() == [True, True, False]
        assert np.array_equal(dsts[0], srcs[0]) and np.array_equal(dsts[1], srcs[1])
