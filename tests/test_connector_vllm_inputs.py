"""Engine inputs and KV cache specs the vLLM connector's keys do not cover are never
served or stored: prompt-embedding requests are a miss and save nothing, a request
without token ids goes through every scheduler hook without raising, and a KV cache
spec other than full attention / MLA is refused by name at construction.

Driven by vLLM's real Scheduler, Request and KVCacheConfig classes on CPU."""

import time
import uuid
from types import SimpleNamespace

import pytest
import torch

from tests import vllm_support as vs

vs.require_vllm()

from kvstore.errors import ConfigError  # noqa: E402

CHUNK = 32                       # two vLLM blocks of 16 tokens
PROMPT = list(range(10, 110))    # 100 tokens: 3 full chunks
PLACEHOLDER = 7                  # the id vLLM puts at embedded positions
HIDDEN = vs.HEADS * vs.HEAD_SIZE


@pytest.fixture
def engines(tmp_path):
    """Factory of (scheduler, worker) over one embedded store per test."""
    model = vs.model_dir(tmp_path)
    tier = f"t{uuid.uuid4().hex[:8]}"
    made = []

    def make(**options):
        extra = {"store": vs.store_config(name=tier), "chunk_tokens": CHUNK, **options}
        vc = vs.vllm_config(model, extra)
        kcc = vs.kv_cache_config(vc)
        sched, worker = vs.scheduler(vc, kcc), vs.worker_connector(vc, kcc)
        worker.register_kv_caches(vs.kv_caches(kcc, "LBHNC", seed=3))
        made.append((sched, worker))
        return sched, worker

    yield make
    for sched, worker in made:
        worker.shutdown()
        sched.connector.shutdown()


def embeds_request(req_id, *, seed, token_ids=True):
    """A request whose positions 40-99 are prompt embeddings (placeholder ids), or,
    with ``token_ids=False``, one given only embeddings (``prompt_token_ids=None``)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    embeds = torch.randn(len(PROMPT), HIDDEN, generator=torch.Generator().manual_seed(seed))
    mask = [i < 40 for i in range(len(PROMPT))]
    ids = [t if m else PLACEHOLDER for t, m in zip(PROMPT, mask)]
    return Request(req_id, ids if token_ids else None, SamplingParams(max_tokens=1), None,
                   prompt_embeds=embeds, prompt_is_token_ids=mask if token_ids else None,
                   block_hasher=get_request_block_hasher(vs.BLOCK, sha256))


def run(sched, worker, req):
    """Schedule ``req`` to completion; returns every step's connector metadata."""
    sched.add_request(req)
    metas = []
    deadline = time.monotonic() + 30
    while sched.has_unfinished_requests() or req.request_id in sched.requests:
        out = sched.schedule()
        metas.append(out.kv_connector_metadata)
        kv_out = vs.run_worker_step(worker, out.kv_connector_metadata, out.finished_req_ids)
        sched.update_from_output(out, vs.model_output(out, kv_out))
        if not out.num_scheduled_tokens:
            time.sleep(0.005)
        assert time.monotonic() < deadline, "request did not finish"
    time.sleep(0.1)   # async saves, had there been any, land
    return metas


def uncached(store):
    return store.stats()["connectors"]["vllm"]["uncached_requests"]


def test_prompt_embeds_requests_with_the_same_placeholder_ids_never_share_kv(engines):
    s1, w1 = engines()
    metas = run(s1, w1, embeds_request("e1", seed=1))
    assert not [t for m in metas for t in m.saves]          # nothing saved under token-id keys
    assert w1.store.stats()["blocks"] == 0

    s2, w2 = engines()
    req = embeds_request("e2", seed=2)                       # same ids, other embeddings
    s2.add_request(req)
    assert s2.connector.get_num_new_matched_tokens(req, 0) == (0, False)
    out = s2.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0 and not out.kv_connector_metadata.loads
    assert uncached(w1.store) >= 2                           # counted once per request


def test_prompt_embeds_request_is_not_offered_a_stored_token_prefix(engines):
    """Even where the store holds the plain-token prompt, an embeddings request with the
    same ids (placeholders at embedded positions) loads nothing."""
    s1, w1 = engines()
    ids = [t if i < 40 else PLACEHOLDER for i, t in enumerate(PROMPT)]
    run(s1, w1, vs.request("plain", ids))
    assert w1.store.stats()["blocks"] == 3
    s2, w2 = engines()
    req = embeds_request("e", seed=1)
    assert req.prompt_token_ids == ids
    metas = run(s2, w2, req)
    assert not [t for m in metas for t in (*m.loads, *m.saves)]


def test_embeddings_only_request_goes_through_every_hook_as_a_miss(engines):
    from vllm.v1.core.sched.output import CachedRequestData

    s1, w1 = engines()
    run(s1, w1, vs.request("plain", [0] * len(PROMPT)))      # vLLM's ids for an embeds-only prompt
    s2, w2 = engines()
    conn = s2.connector
    req = embeds_request("only", seed=4, token_ids=False)
    assert req.prompt_token_ids is None
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.update_state_after_alloc(req, SimpleNamespace(blocks=([],)), 0)
    new = SimpleNamespace(req_id="only", block_ids=([1, 2, 3, 4, 5, 6, 7],), num_computed_tokens=0)
    meta = conn.build_connector_meta(SimpleNamespace(
        num_scheduled_tokens={"only": len(PROMPT)}, scheduled_new_reqs=[new],
        scheduled_cached_reqs=CachedRequestData.make_empty()))
    assert not meta.loads and not meta.saves
    assert conn.request_finished(req, [1, 2, 3, 4, 5, 6, 7]) == (False, None)
    # And end to end through vLLM's Scheduler.
    metas = run(s2, w2, embeds_request("only2", seed=5, token_ids=False))
    assert not [t for m in metas for t in (*m.loads, *m.saves)]


def test_a_chunk_holding_the_null_block_is_never_saved(engines):
    """vLLM's null block (id 0) stands for a block the request does not hold (behind a
    window): a chunk that includes it is not this request's KV."""
    from vllm.v1.core.sched.output import CachedRequestData

    s, _ = engines()
    conn = s.connector
    req = vs.request("n", PROMPT)
    conn.on_new_request(req)
    new = SimpleNamespace(req_id="n", block_ids=([5, 6, 0, 8, 9, 10, 11],), num_computed_tokens=0)
    meta = conn.build_connector_meta(SimpleNamespace(
        num_scheduled_tokens={"n": len(PROMPT)}, scheduled_new_reqs=[new],
        scheduled_cached_reqs=CachedRequestData.make_empty()))
    assert [(t.first_chunk, t.block_ids) for t in meta.saves] == [(0, [5, 6])]
    cached = CachedRequestData.make_empty()
    cached.req_ids, cached.new_block_ids, cached.num_computed_tokens = ["n"], [None], [len(PROMPT)]
    later = conn.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"n": 1}, scheduled_new_reqs=[],
                                                      scheduled_cached_reqs=cached))
    assert not later.saves                                   # nor any chunk after it


def _specs():
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, CrossAttentionSpec, MambaSpec,
                                            SlidingWindowSpec)

    attn = dict(block_size=vs.BLOCK, num_kv_heads=vs.HEADS, head_size=vs.HEAD_SIZE, dtype=torch.float16)
    return {
        "SlidingWindowSpec": SlidingWindowSpec(sliding_window=64, **attn),
        "ChunkedLocalAttentionSpec": ChunkedLocalAttentionSpec(attention_chunk_size=64, **attn),
        "CrossAttentionSpec": CrossAttentionSpec(**attn),
        "MambaSpec": MambaSpec(block_size=vs.BLOCK, shapes=((4, 64), (4, 16, 16)),
                               dtypes=(torch.float16, torch.float16)),
    }


@pytest.mark.parametrize("name", ["SlidingWindowSpec", "MambaSpec", "ChunkedLocalAttentionSpec",
                                  "CrossAttentionSpec"])
@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_unsupported_kv_cache_specs_are_refused_by_name_at_construction(tmp_path, name, role):
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from kvstore.connectors.vllm import KVStoreConnector

    vc = vs.vllm_config(vs.model_dir(tmp_path), {"store": vs.store_config(), "chunk_tokens": CHUNK})
    names = [f"model.layers.{i}.mixer" for i in range(vs.LAYERS)]
    kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, _specs()[name])])
    with pytest.raises(ConfigError, match=rf"{name}.*model\.layers\.0\.mixer"):
        KVStoreConnector(vc, KVConnectorRole[role], kcc)


def test_full_attention_and_mla_specs_are_still_accepted(tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    from kvstore.connectors.vllm import KVStoreConnector

    vc = vs.vllm_config(vs.model_dir(tmp_path), {"store": vs.store_config(), "chunk_tokens": CHUNK})
    for spec, mla in ((FullAttentionSpec(block_size=vs.BLOCK, num_kv_heads=vs.HEADS, head_size=vs.HEAD_SIZE,
                                         dtype=torch.float16), False),
                      (MLAAttentionSpec(block_size=vs.BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16),
                       True)):
        kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(vs.layer_names(), spec)])
        conn = KVStoreConnector(vc, KVConnectorRole.SCHEDULER, kcc)
        assert conn.shape.mla is mla
        conn.shutdown()
