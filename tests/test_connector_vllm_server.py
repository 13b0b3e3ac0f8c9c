"""The vLLM connector against a real kvstore cache server on 127.0.0.1 (server mode):
two engines, each with its own client, share prefixes through the server."""

import pytest
import torch

from tests import vllm_support as vs

vs.require_vllm()
pytest.importorskip("kvstore.client", reason="the cache server is not in this build")
servers = pytest.importorskip("tests._servers", reason="the cache server is not in this build")

from tests.test_connector_vllm import CHUNK, PROMPT, blocks_of, run_to_completion, same_pages, step  # noqa: E402

TOKEN = "vllm-test-token"


@pytest.fixture
def server():
    srv = servers.ThreadServer(servers.config_dict(token=TOKEN))
    yield srv
    srv.stop()


@pytest.fixture
def engines(tmp_path, server):
    model = vs.model_dir(tmp_path)
    made = vs.Engines()

    def make(seed=None, **options):
        extra = {"server": server.address, "token": TOKEN, "chunk_tokens": CHUNK, **options}
        return made.make(vs.vllm_config(model, extra), seed)

    yield make
    made.shutdown()


def test_prefix_saved_by_one_engine_loads_in_another(engines, server):
    s1, w1, c1 = engines(seed=11)
    saves = run_to_completion(s1, w1, vs.request("r1", PROMPT))
    assert server.store.stats()["blocks"] == 3
    s2, w2, c2 = engines()
    run_to_completion(s2, w2, vs.request("other", list(range(500, 540))))
    s2.add_request(vs.request("r2", PROMPT[:96] + list(range(600, 640))))
    out, kv_out = step(s2, w2)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 96
    (load,) = out.kv_connector_metadata.loads
    assert not kv_out.invalid_block_ids
    assert same_pages(c1, blocks_of(saves), c2, blocks_of([load]))


def test_chunk_lost_on_the_server_fails_closed(engines, server):
    s1, w1, _ = engines(seed=12)
    run_to_completion(s1, w1, vs.request("r1", PROMPT))
    s2, w2, c2 = engines()
    before = {n: t.clone() for n, t in c2.items()}
    s2.add_request(vs.request("r2", PROMPT[:96] + list(range(700, 710))))
    out = s2.schedule()
    (load,) = out.kv_connector_metadata.loads
    server.store.delete([load.keys[0][2]])
    kv_out = vs.run_worker_step(w2, out.kv_connector_metadata)
    assert kv_out.invalid_block_ids == set(load.chunk(2))
    bad = torch.tensor(load.chunk(2))
    assert all(torch.equal(c2[n][bad], before[n][bad]) for n in c2)
