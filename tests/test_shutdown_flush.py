"""The flush that writes DRAM-only blocks down to the first persistent tier (the cache
server's shutdown, ``Store.flush``): it is not an offer, so the persistent tier's
admission (``min_hits: 2``, the README's own NVMe setting) does not refuse it; it still
keeps to the tier's capacity, never writes a block that fails its checksum, and says in
one log line how many blocks it kept and how many it dropped, and why."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.store import Store
from kvstore.testing import make_keys, payload

pytest.importorskip("kvstore.tiers.nvme", reason="the NVMe tier is not in this build")

BLOCK = 64 * 1024


def _config(path, *, hot_blocks=32, disk_blocks=64, min_hits=2):
    return {"tiers": [
        {"name": "hot", "kind": "dram", "capacity": hot_blocks * BLOCK, "pin": False},
        {"name": "disk", "kind": "nvme", "path": str(path), "capacity": disk_blocks * BLOCK,
         "file_bytes": "1MiB", "admission": {"min_hits": min_hits}},
    ]}


def _flush_lines(caplog):
    return [r for r in caplog.records if r.name == "kvstore.store" and "flush" in r.getMessage()]


def test_flush_bypasses_admission_and_a_reopened_store_serves_every_block(tmp_path, caplog):
    keys, srcs = make_keys(8, salt="flush"), [payload(i, BLOCK) for i in range(8)]
    with Store.from_config(_config(tmp_path)) as store:
        assert store.save(keys, srcs).result() == [True] * 8
        with caplog.at_level(logging.INFO, logger="kvstore.store"):
            assert store.flush() == 8
        assert store.tiers[1].contains(keys) == [True] * 8
        assert store.stats()["tiers"][1]["rejected"] == 0   # no offer was made, none refused
    (line,) = _flush_lines(caplog)
    msg = line.getMessage()
    assert line.levelno == logging.INFO
    assert "8 of 8" in msg and "disk (nvme)" in msg and "0 dropped" in msg, msg
    with Store.from_config(_config(tmp_path)) as store:
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert store.load(keys, dsts).result() == [True] * 8
        assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))


def test_admission_still_refuses_first_offers_when_blocks_spill(tmp_path):
    with Store.from_config(_config(tmp_path, hot_blocks=4)) as store:
        keys = make_keys(10, salt="spill")
        for i, key in enumerate(keys):   # one save each: DRAM spills its oldest, once each
            assert store.save([key], [payload(i, BLOCK)]).result() == [True]
        disk = store.stats()["tiers"][1]
        assert disk["rejected"] == 6 and disk["writes"] == 0
        assert store.flush() == 4   # what DRAM still holds goes down at the flush


def test_flush_keeps_to_capacity_and_reports_the_blocks_without_room(tmp_path, caplog):
    keys = make_keys(8, salt="room")
    with Store.from_config(_config(tmp_path, disk_blocks=4)) as store:
        assert store.save(keys, [payload(i, BLOCK) for i in range(8)]).result() == [True] * 8
        with caplog.at_level(logging.INFO, logger="kvstore.store"):
            assert store.flush() == 4
        disk = store.tiers[1]
        assert disk.used_bytes <= disk.capacity_bytes
        assert sum(disk.contains(keys)) == 4
    (line,) = _flush_lines(caplog)
    msg = line.getMessage()
    assert line.levelno == logging.WARNING
    assert "4 of 8" in msg and "4 dropped" in msg and "4 no room" in msg and "0 failed" in msg, msg


def test_flush_never_writes_a_block_that_fails_its_checksum(tmp_path, caplog):
    keys, srcs = make_keys(4, salt="bad"), [payload(i, BLOCK) for i in range(4)]
    with Store.from_config(_config(tmp_path)) as store:
        assert store.save(keys, srcs).result() == [True] * 4
        hot = store.tiers[0]
        offset, _ = hot.offset_of(keys[1])
        hot.arena[offset + 5] ^= 0x01      # a byte flipped in DRAM after the save
        with caplog.at_level(logging.INFO, logger="kvstore.store"):
            assert store.flush() == 3
        assert store.tiers[1].contains(keys) == [True, False, True, True]
    msg = _flush_lines(caplog)[0].getMessage()
    assert "3 of 4" in msg and "1 failed" in msg, msg


def test_server_shutdown_flush_bypasses_admission(tmp_path):
    from tests._servers import ProcessServer

    raw = {**_config(tmp_path / "data"), "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0}}
    (tmp_path / "data").mkdir()
    keys, srcs = make_keys(8, salt="srv"), [payload(i, BLOCK) for i in range(8)]
    err = tmp_path / "stderr.txt"
    s = ProcessServer(raw, tmp_path, stderr_path=err)
    try:
        with Client(s.address) as c:
            assert c.save(keys, srcs).result(30) == [True] * 8
        assert s.terminate() == 0
    finally:
        s.kill()
    log = err.read_text()
    assert "8 of 8" in log and "disk (nvme)" in log, log
    s2 = ProcessServer(raw, tmp_path)
    try:
        with Client(s2.address) as c:
            dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
            assert c.load(keys, dsts).result(30) == [True] * 8
            assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))
    finally:
        s2.kill()
