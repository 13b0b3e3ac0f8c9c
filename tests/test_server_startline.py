"""What ``kvstore serve`` says about itself: the start line names each tier (kind,
capacity, where its data lives, blocks recovered) and the shared arena's size; INFO
(serve's default) logs the start-up steps, including the pre-fault of a large DRAM
arena with its progress; sizes are printed in the unit that fits them."""

from __future__ import annotations

import io
import logging
import mmap

import numpy as np
import pytest

from kvstore.cli.stats import render
from kvstore.client import Client
from kvstore.config.base import format_size, parse_size
from kvstore.testing import make_keys, payload
from tests._servers import ProcessServer

BLOCK = 64 * 1024


@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1 KiB"), (1536, "1.5 KiB"), (64 << 10, "64 KiB"),
    (10**6, "976.6 KiB"), ((1 << 20) - 1, "1 MiB"), (16 << 20, "16 MiB"), (3 << 29, "1.5 GiB"),
    (8 << 30, "8 GiB"), (3 << 40, "3 TiB"),
])
def test_format_size_picks_the_unit_that_fits(nbytes, text):
    assert format_size(nbytes) == text
    assert abs(parse_size(text.replace(" ", "")) - nbytes) <= max(1, nbytes // 200)   # reads back


def test_stats_prints_small_tiers_in_their_own_unit():
    tier = {"name": "hot", "kind": "dram", "used_bytes": 8192, "capacity_bytes": 4 << 20, "blocks": 2, "hits": 1,
            "misses": 0, "evictions": 0, "corruptions": 0}
    out = render({"blocks": 2, "leases": 0, "tiers": [tier],
                  "tenants": {"a": {"hits": 0, "misses": 0, "tiers": {"hot": {"used_bytes": 4096, "quota_bytes": 1 << 20,
                                                                                 "evictions": 0}}}}})
    assert "0.00 GiB" not in out
    assert "8 KiB" in out and "4 MiB" in out and "hot 4 KiB of 1 MiB" in out


def _raw(tmp_path):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    return {"tiers": [{"name": "hot", "kind": "dram", "capacity": "16MiB", "pin": False},
                      {"name": "disk", "kind": "nvme", "path": str(data), "capacity": "32MiB", "file_bytes": "16MiB"}],
            "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0, "token": "startline-token"}}, data


def test_start_line_names_tiers_arena_and_recovered_blocks(tmp_path):
    pytest.importorskip("kvstore.tiers.nvme", reason="the NVMe tier is not in this build")
    raw, data = _raw(tmp_path)
    s = ProcessServer(raw, tmp_path, stderr_path=tmp_path / "first.err")
    try:
        assert f"disk(nvme, 32 MiB, {data}, 0 blocks recovered)" in s.ready_line, s.ready_line
        with Client(s.address, token="startline-token") as c:
            assert all(c.save(make_keys(4), [payload(i, BLOCK) for i in range(4)]).result(30))
        assert s.terminate() == 0
    finally:
        s.kill()
    err = tmp_path / "second.err"
    s = ProcessServer(raw, tmp_path, stderr_path=err)
    try:
        line = s.ready_line
        assert line.startswith(f"kvstore: serving on 127.0.0.1:{s.port} admin={s.admin_port} socket="), line
        assert f"shm={s.shm_path} (16 MiB)" in line, line
        assert "tiers=[hot(dram, 16 MiB), " in line, line
        assert f"disk(nvme, 32 MiB, {data}, 4 blocks recovered)" in line, line
        assert "tls=off" in line
    finally:
        s.kill()
    log = err.read_text()   # serve logs at INFO by default: its start-up steps
    for step in ("pre-faulting 16 MiB DRAM arena", "arena in shared memory", "tier disk (nvme, 32 MiB) opened in",
                 "tier disk (nvme): 4 blocks (256 KiB) recovered in", "listening: tcp 127.0.0.1:"):
        assert step in log, (step, log)


def test_log_level_warning_keeps_start_up_quiet(tmp_path):
    raw = {"tiers": [{"name": "hot", "kind": "dram", "capacity": "4MiB", "pin": False}],
           "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0, "token": "startline-token"}}
    err = tmp_path / "quiet.err"
    s = ProcessServer(raw, tmp_path, stderr_path=err, cli_args=["--log-level", "warning"])
    try:
        assert "tiers=[hot(dram, 4 MiB)]" in s.ready_line
        assert s.terminate() == 0
    finally:
        s.kill()
    assert " INFO " not in err.read_text()


def test_a_large_arena_says_it_pre_faults_and_shows_progress(caplog):
    from kvstore.tiers.dram import DramTier

    with caplog.at_level(logging.INFO, logger="kvstore.tiers.dram"):
        DramTier(256 << 20, name="big", pin=False).close()
    msgs = [r.getMessage() for r in caplog.records if r.name == "kvstore.tiers.dram"]
    assert msgs[0] == "tier big: pre-faulting 256 MiB DRAM arena..."
    assert [m for m in msgs if "%" in m] == [f"tier big: pre-faulted {p}% ({p * 256 // 100} MiB of 256 MiB)"
                                            for p in (25, 50, 75)]
    assert msgs[-1].startswith("tier big: 256 MiB DRAM arena pre-faulted in ")


def test_prefault_touches_every_page_in_pieces_and_reports_each():
    from kvstore.tiers._prefault import FAULT_CHUNK_BYTES, prefault

    total = 3 * FAULT_CHUNK_BYTES + 5 * mmap.PAGESIZE
    mm = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    np.frombuffer(mm, dtype=np.uint8)[::mmap.PAGESIZE] = 7
    seen = []
    prefault(mm, None, name="t", progress=lambda done, of: seen.append((done, of)))
    assert seen == [(FAULT_CHUNK_BYTES * k, total) for k in (1, 2, 3)] + [(total, total)]
    assert not np.frombuffer(mm, dtype=np.uint8)[::mmap.PAGESIZE].any()
    mm.close()


def test_prefault_draws_a_bar_on_a_terminal(monkeypatch):
    from kvstore.tiers import _prefault

    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    monkeypatch.setattr(_prefault.sys, "stderr", stream)
    mm = mmap.mmap(-1, _prefault.PROGRESS_MIN_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _prefault.prefault(mm, None, name="tty")
    mm.close()
    assert "pre-faulting tty" in stream.getvalue()
