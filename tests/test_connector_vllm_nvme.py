"""Fail-closed loads with real corruption: a chunk stored on the NVMe tier has bytes
flipped on disk; the tier's checksum catches it, and the connector reports the
chunk's blocks as load errors without writing a byte of them."""

import os

import pytest
import torch

from tests import vllm_support as vs

vs.require_vllm()
pytest.importorskip("kvstore.tiers.nvme", reason="the NVMe tier is not in this build")

from tests.test_connector_vllm import CHUNK, PROMPT, run_to_completion  # noqa: E402
from kvstore.tiers.nvme.io import PAGE  # noqa: E402


def test_corrupted_chunk_on_disk_is_reported_not_loaded(tmp_path):
    model = vs.model_dir(tmp_path)
    store = {"tiers": [{"name": "disk", "kind": "nvme", "path": str(tmp_path / "nvme"),
                        "capacity": "64MiB", "file_bytes": "16MiB"}]}
    vc = vs.vllm_config(model, {"store": store, "chunk_tokens": CHUNK})
    kcc = vs.kv_cache_config(vc)
    s1, w1 = vs.scheduler(vc, kcc), vs.worker_connector(vc, kcc)
    w1.register_kv_caches(vs.kv_caches(kcc, "LBHNC", seed=21))
    s2, w2 = vs.scheduler(vc, kcc), vs.worker_connector(vc, kcc)
    c2 = vs.kv_caches(kcc, "LBHNC")
    w2.register_kv_caches(c2)
    try:
        run_to_completion(s1, w1, vs.request("r1", PROMPT))
        s2.add_request(vs.request("r2", PROMPT[:96] + list(range(900, 910))))
        out = s2.schedule()
        (load,) = out.kv_connector_metadata.loads
        tier = w2.store.tiers[0]
        entry = tier._entries[load.keys[0][1]]
        data = os.path.join(tmp_path / "nvme", f"data-{entry.file_no:05d}.kvd")
        with open(data, "r+b") as f:                 # flip payload bytes of chunk 1
            f.seek(entry.offset + PAGE + 100)
            old = f.read(4)
            f.seek(entry.offset + PAGE + 100)
            f.write(bytes(b ^ 0xFF for b in old))
        before = {n: t.clone() for n, t in c2.items()}
        kv_out = vs.run_worker_step(w2, out.kv_connector_metadata)
        bad = load.chunk(1) + load.chunk(2)
        assert kv_out.invalid_block_ids == set(bad)
        idx = torch.tensor(bad)
        assert all(torch.equal(c2[n][idx], before[n][idx]) for n in c2)
        assert w2.store.stats()["tiers"][0]["corruptions"] >= 1
    finally:
        for conn in (w1, w2, s1.connector, s2.connector):
            conn.shutdown()
