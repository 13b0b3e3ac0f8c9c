"""The NVMe tier's ``device_verify``: blocks written with the segmented checksum
(``FLAG_SEGMENTED``) read back through the host path with the option on and off, a
flipped byte is a miss either way, and where the payload is verified."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvstore import Store
from kvstore.block import FLAG_SEGMENTED, HEADER_BYTES, parse_block_header
from kvstore.testing import make_keys, payload
from kvstore.tiers.nvme.fsck import fsck
from kvstore.tiers.nvme.gpu import verify_where
from kvstore.tiers.nvme.io import PAGE
from kvstore.tiers.nvme import NvmeTier

SEG = 64 << 10
# several segments and page multiples (one pwritev per run), one segment, odd sizes (own path)
SIZES = [4 * SEG, 3 * SEG + PAGE, SEG, 2 * SEG + 3, 5 * SEG + 1001, 700]


def open_tier(path, device_verify):
    return NvmeTier(path, 64 << 20, name="nvme-dv", file_bytes=8 << 20, io_threads=2, device_verify=device_verify)


def header_flags(path, entry) -> int:
    with open(os.path.join(path, f"data-{entry.file_no:05d}.kvd"), "rb") as f:
        f.seek(entry.offset)
        return parse_block_header(f.read(HEADER_BYTES)).flags


@pytest.fixture
def written(tmp_path):
    """A closed tier directory whose blocks were written with ``device_verify`` on."""
    path = str(tmp_path / "d")
    keys = make_keys(len(SIZES))
    t = open_tier(path, True)
    assert t.write(keys, [payload(i, n) for i, n in enumerate(SIZES)]) == [True] * len(SIZES)
    assert t.stats()["device_verify"] is True
    entries = dict(t._entries)
    t.close()
    return path, keys, entries


def read_all(t, keys) -> list[bool]:
    out = []
    for i, (key, n) in enumerate(zip(keys, SIZES)):
        dst = np.zeros(n, np.uint8)
        ok = t.read_into([key], [dst])[0]
        assert not ok or np.array_equal(dst, payload(i, n)), "wrong bytes reported as loaded"
        out.append(ok)
    return out


def test_writes_carry_the_flag_only_when_asked(written, tmp_path):
    path, keys, entries = written
    assert all(header_flags(path, entries[k]) == FLAG_SEGMENTED for k in keys)
    plain = str(tmp_path / "plain")
    t = open_tier(plain, False)
    try:
        assert all(t.write(keys[:2], [payload(0, SIZES[0]), payload(1, SIZES[1])]))
        assert [header_flags(plain, t._entries[k]) for k in keys[:2]] == [0, 0]
        assert t.stats()["device_verify"] is False
    finally:
        t.close()


@pytest.mark.parametrize("device_verify", [True, False])
def test_flagged_blocks_read_back_with_the_option_on_and_off(written, device_verify):
    path, keys, _ = written
    t = open_tier(path, device_verify)
    try:
        assert read_all(t, keys) == [True] * len(keys)
        assert t.stats()["corrupt_blocks"] == 0
        # a whole batch at once: contiguous page-multiple blocks are read and checked as runs
        dsts = [np.zeros(n, np.uint8) for n in SIZES]
        assert t.read_into(keys, dsts) == [True] * len(keys)
        assert all(np.array_equal(d, payload(i, n)) for i, (d, n) in enumerate(zip(dsts, SIZES)))
    finally:
        t.close()
    assert fsck(path, progress=False).problems == 0


@pytest.mark.parametrize("device_verify", [True, False])
@pytest.mark.parametrize("victim", [0, 3])
def test_a_flipped_payload_byte_is_a_miss_either_way(written, device_verify, victim):
    path, keys, entries = written
    e = entries[keys[victim]]
    at = e.offset + PAGE + SIZES[victim] - 2 * SEG // 3   # inside the last segment
    with open(os.path.join(path, f"data-{e.file_no:05d}.kvd"), "r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 0x01]))
    t = open_tier(path, device_verify)
    try:
        assert read_all(t, keys) == [i != victim for i in range(len(keys))]
        assert t.stats()["corrupt_blocks"] == 1
        assert t.contains([keys[victim]]) == [False]   # the copy is gone
    finally:
        t.close()


def test_mixed_blocks_in_one_tier(tmp_path):
    """A tier turned on over blocks written without the flag (and back) reads both kinds."""
    path = str(tmp_path / "d")
    keys = make_keys(4)
    for i, flag in enumerate((False, True, False, True)):
        t = open_tier(path, flag)
        try:
            assert t.write(keys[i:i + 1], [payload(i, 3 * SEG)]) == [True]
            dsts = [np.zeros(3 * SEG, np.uint8) for _ in range(i + 1)]
            assert t.read_into(keys[:i + 1], dsts) == [True] * (i + 1)
            assert all(np.array_equal(d, payload(j, 3 * SEG)) for j, d in enumerate(dsts))
            assert [header_flags(path, t._entries[k]) for k in keys[:i + 1]] == [0, 1, 0, 1][:i + 1]
        finally:
            t.close()


def test_verification_stays_on_the_host_for_host_buffers():
    assert verify_where(FLAG_SEGMENTED, torch.zeros(8, dtype=torch.uint8)) == "host"
    assert verify_where(FLAG_SEGMENTED, np.zeros(8, np.uint8)) == "host"
    assert verify_where(0, torch.zeros(8, dtype=torch.uint8)) == "host"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_verification_moves_to_the_device_for_flagged_blocks_in_cuda_memory():
    dst = torch.zeros(8, dtype=torch.uint8, device="cuda")
    assert verify_where(FLAG_SEGMENTED, dst) == "device"
    assert verify_where(0, dst) == "host"


def test_device_verify_from_config(tmp_path):
    config = {"tiers": [{"name": "hot", "kind": "dram", "capacity": "4MiB"},
                        {"name": "warm", "kind": "nvme", "path": str(tmp_path / "n"), "capacity": "64MiB",
                         "device_verify": True}],
              "placement": {"write": "through"}}
    keys = make_keys(2)
    with Store.from_config(config) as store:
        assert store.save(keys, [payload(0, 3 * SEG), payload(1, 3 * SEG)]).result() == [True, True]
        warm = [t for t in store.stats()["tiers"] if t["name"] == "warm"][0]
        assert warm["device_verify"] is True and warm["verified_on_device"] == 0
    t = open_tier(str(tmp_path / "n"), False)
    try:
        assert [header_flags(str(tmp_path / "n"), t._entries[k]) for k in keys] == [FLAG_SEGMENTED] * 2
        dst = np.zeros(3 * SEG, np.uint8)
        assert t.read_into(keys[:1], [dst]) == [True] and np.array_equal(dst, payload(0, 3 * SEG))
    finally:
        t.close()


@pytest.mark.parametrize("corrupt", [False, True])
def test_read_ahead_copies_of_flagged_blocks_are_checked(tmp_path, corrupt):
    """Blocks served from the read-ahead window are verified by their own checksum kind."""
    n, batch, batches = 3 * SEG, 4, 5
    t = NvmeTier(str(tmp_path / "d"), 64 << 20, name="nvme-dv-ra", file_bytes=16 << 20, io_threads=2,
                 readahead_bytes=4 << 20, device_verify=True)
    try:
        if t.io_mode != "direct":
            pytest.skip(f"read-ahead needs O_DIRECT; the test directory gives {t.io_mode}")
        keys = make_keys(batch * batches, salt="ra")
        for s in range(0, len(keys), batch):
            assert all(t.write(keys[s:s + batch], [payload(i, n) for i in range(s, s + batch)]))
        victim = len(keys) - 2   # in the last batch: served from the read-ahead
        if corrupt:
            e = t._entries[keys[victim]]
            with open(os.path.join(t._shards[0].path, f"data-{e.file_no:05d}.kvd"), "r+b") as f:
                f.seek(e.offset + PAGE + 2 * SEG + 7)
                old = f.read(1)
                f.seek(e.offset + PAGE + 2 * SEG + 7)
                f.write(bytes([old[0] ^ 0x80]))
        got = []
        for s in range(0, len(keys), batch):
            dsts = [np.zeros(n, np.uint8) for _ in range(batch)]
            ok = t.read_into(keys[s:s + batch], dsts)
            for i, (good, dst) in enumerate(zip(ok, dsts)):
                assert not good or np.array_equal(dst, payload(s + i, n)), "wrong bytes reported as loaded"
            got += ok
        assert got == [not (corrupt and i == victim) for i in range(len(keys))]
        assert t.stats()["readahead_hits"] > 0
        assert t.stats()["corrupt_blocks"] == int(corrupt)
    finally:
        t.close()
