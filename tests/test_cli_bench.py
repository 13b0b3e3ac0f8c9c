"""``kvstore bench``: fresh keys per run, a temporary data dir, a row per tier, a
server mode, and nothing of the bench's left behind. Behaviour only, never timing."""

import json
import os
import subprocess
import sys
from concurrent.futures import Future

import numpy as np

from kvstore.cli._bench import Workload, measure
from kvstore.config import DEFAULT_CONFIG
from kvstore.keys import Namespace
from kvstore.store import Store
from tests._servers import ROOT, ProcessServer

SMALL = ["--block-size", "64KiB", "--blocks", "16", "--batch", "8", "--rounds", "2", "--json"]


def bench(*args, cwd, env=None):
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    full.pop("KVSTORE_CONFIG", None)
    out = subprocess.run([sys.executable, "-m", "kvstore", "bench", *args], cwd=cwd, env=full,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_reruns_on_the_default_config_write_fresh_keys_into_a_temp_dir_that_goes(tmp_path):
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    for _ in range(2):      # the second run must write as much as the first: its keys are new
        result = bench(*SMALL, cwd=cwd, env={"TMPDIR": str(tmp)})
        rows = result["rows"]
        assert [(r["tier"], r["kind"]) for r in rows] == [(t["name"], t["kind"]) for t in DEFAULT_CONFIG["tiers"]]
        assert {r["kind"] for r in rows} == {"dram", "nvme"}
        for row in rows:
            assert row["blocks"] == row["saved"] == row["hits"] == row["verified"] == 32, row
            assert row["corrupt"] == row["missing"] == 0 and row["deleted"] == 32
            assert row["stats"]["bytes_written"] == 32 * 64 * 1024      # really written, this run
            assert row["stats"]["blocks"] == 0                          # and deleted again
        assert result["data_dir_kept"] is False and result["data_dir"].startswith(str(tmp))
        assert list(cwd.iterdir()) == []     # no ./kvstore-data
        assert list(tmp.iterdir()) == []     # the temporary data dir is removed


def test_data_dir_is_used_and_kept(tmp_path):
    result = bench(*SMALL, "--data-dir", "data", cwd=tmp_path)
    assert result["data_dir"] == str(tmp_path / "data") and result["data_dir_kept"] is True
    assert (tmp_path / "data" / "index").exists()
    assert [r["verified"] for r in result["rows"]] == [32, 32]


def test_a_given_config_is_left_as_found_and_benched_within_its_free_room(tmp_path):
    cfg = tmp_path / "kv.yaml"
    cfg.write_text(f"tiers:\n  - {{name: hot, kind: dram, capacity: 1MiB}}\n"
                   f"  - {{name: disk, kind: nvme, path: {tmp_path / 'disk'}, capacity: 2MiB}}\n")
    ns = Namespace(model="user", dtype="uint8", chunk_tokens=1)
    keys = ns.chunk_keys(range(4))
    mine = [np.full(64 << 10, i, np.uint8) for i in range(4)]
    with Store.from_config(str(cfg)) as store:
        assert all(store.save(keys, mine).result())
        store.flush()       # the user's blocks now live on disk
    result = bench("--config", str(cfg), "--block-size", "64KiB", "--blocks", "64", "--batch", "8",
                   "--rounds", "2", "--json", cwd=tmp_path)
    hot, disk = result["rows"]
    assert (hot["tier"], disk["tier"]) == ("hot", "disk")
    assert hot["blocks"] == 2 * 16 and hot["capped"]          # 1 MiB of DRAM: 16 blocks a round
    assert disk["blocks"] == 2 * 28 and disk["capped"]        # 2 MiB less the user's 256 KiB
    assert all(r["verified"] == r["blocks"] and r["corrupt"] == 0 for r in (hot, disk))
    with Store.from_config(str(cfg)) as store:
        assert store.stats()["blocks"] == 4
        back = [np.empty(64 << 10, np.uint8) for _ in range(4)]
        assert all(store.load(keys, back).result())
        assert all(np.array_equal(a, b) for a, b in zip(back, mine))


def test_server_mode_round_trips_and_deletes_its_keys(tmp_path):
    raw = {"tiers": [{"name": "hot", "kind": "dram", "capacity": "8MiB", "pin": False},
                     {"name": "warm", "kind": "nvme", "path": str(tmp_path / "data"), "capacity": "32MiB"}],
           "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0, "token": "bench-secret",
                      "socket_path": str(tmp_path / "kv.sock")}}
    server = ProcessServer(raw, tmp_path)
    try:
        from kvstore.client import Client

        ns = Namespace(model="user", dtype="uint8", chunk_tokens=1)
        keys = ns.chunk_keys(range(3))
        with Client(server.address, token="bench-secret", transport="tcp") as client:
            assert all(client.save(keys, [np.full(4096, i, np.uint8) for i in range(3)]).result())
            before = client.stats()["blocks"]
        result = bench("--server", server.address, *SMALL, cwd=tmp_path, env={"KVSTORE_TOKEN": "bench-secret"})
        assert result["mode"] == "server"
        (row,) = result["rows"]
        assert row["blocks"] == row["saved"] == row["found"] == row["verified"] == 32, row
        assert row["corrupt"] == row["missing"] == 0 and row["deleted"] == 32
        with Client(server.address, token="bench-secret", transport="tcp") as client:
            assert client.stats()["blocks"] == before == 3
            assert client.contains(keys) == [True] * 3
    finally:
        server.kill()


def test_a_load_that_returns_wrong_bytes_is_counted_corrupt():
    class Flipping:
        """A Store whose loads flip one byte of every other block."""

        def __init__(self, store):
            self.store = store
            self.save, self.delete = store.save, store.delete

        def load(self, keys, dsts):
            hits = self.store.load(keys, dsts).result()
            for dst in dsts[::2]:
                dst[-1] ^= 0xFF
            fut = Future()
            fut.set_result(hits)
            return fut

    with Store.from_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": "1MiB"}]}) as store:
        out = measure(Flipping(store), Workload(4096, 8, 4, 1))
        assert (out["saved"], out["hits"], out["verified"], out["corrupt"]) == (8, 8, 4, 4)
        assert store.stats()["blocks"] == 0
