"""Retention hints from vLLM requests (issue 22): the OpenAI API's ``extra_body``
(``kv_transfer_params``) parsed by vLLM's own ChatCompletionRequest into a real
Request, the request's ``priority`` and its ``kv_hints`` envelope, through vLLM's real
Scheduler and the worker hooks, into the store's index; and the KVStoreTier's saves."""

import math

import pytest

from kvstore import Hint
from tests import vllm_support as vs
from tests import test_connector_vllm as base
from tests import test_connector_vllm_tier as tier_base

engines = base.engines        # fixtures: one embedded store per test, real Scheduler + worker,
engine = tier_base.engine     # and a Scheduler whose OffloadingConnector has a KVStoreTier
PROMPT, run_to_completion = base.PROMPT, base.run_to_completion

vs.require_vllm()


def openai_request(req_id: str, body: dict, tokens: list[int]):
    """What vLLM's OpenAI server makes of a chat request with ``body`` merged in (the
    client's ``extra_body``): its sampling params, then the engine's Request."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **body})
    params = chat.to_sampling_params(1, {})
    init_none_hash(sha256)
    return Request(req_id, list(tokens), params, None, priority=chat.priority,
                   block_hasher=get_request_block_hasher(vs.BLOCK, sha256))


def hints_of(store, saves):
    keys = [k for t in saves for k in t.keys_for(0)]
    return [store._hints.get(k) for k in keys]


def test_extra_body_kv_transfer_params_hint_the_saved_chunks(engines):
    sched, worker, _ = engines(seed=1)
    req = openai_request("r1", {"kv_transfer_params": {"kvstore": {"retain_s": 600, "priority": 2}}}, PROMPT)
    assert req.kv_transfer_params == {"kvstore": {"retain_s": 600, "priority": 2}}
    saves = run_to_completion(sched, worker, req)
    recs = hints_of(worker.store, saves)
    assert len(recs) == 3 and all(r is not None and r.priority == 2 and not r.discard for r in recs)
    assert all(math.isfinite(r.expires) for r in recs)
    assert worker.store.stats()["hints"]["given"] >= 3


def test_request_priority_becomes_a_retention_priority(engines):
    sched, worker, _ = engines(seed=2)
    req = openai_request("r1", {"priority": -3}, PROMPT)
    saves = run_to_completion(sched, worker, req)
    recs = hints_of(worker.store, saves)
    assert all(r is not None and r.priority == 3 and r.expires == math.inf for r in recs)
    # the default priority (0) and a deprioritised request (> 0) ask for nothing
    sched2, worker2, _ = engines(seed=3)
    saves = run_to_completion(sched2, worker2, openai_request("r2", {"priority": 5}, [t + 1 for t in PROMPT]))
    assert hints_of(worker2.store, saves) == [None] * 3


def test_discard_and_kv_hints_envelope(engines):
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    sched, worker, _ = engines(seed=4)
    req = vs.request("r1", PROMPT)
    req.kv_hints = KvHintsEnvelope("1", "m1", [KvHintAction("a1", "kvstore", "1", {"discard": True})])
    saves = run_to_completion(sched, worker, req)
    assert all(r is not None and r.discard for r in hints_of(worker.store, saves))


def test_a_malformed_hint_is_logged_and_the_request_runs_unhinted(engines, caplog):
    sched, worker, _ = engines(seed=5)
    req = openai_request("r1", {"kv_transfer_params": {"kvstore": {"retain_s": -1}}}, PROMPT)
    with caplog.at_level("WARNING", logger="kvstore.connectors"):
        saves = run_to_completion(sched, worker, req)
    assert hints_of(worker.store, saves) == [None] * 3
    assert "retain_s" in caplog.text and "r1" in caplog.text


def test_lookup_hints_the_cached_prefix_of_a_later_request(engines):
    s1, w1, _ = engines(seed=6)
    saves = run_to_completion(s1, w1, vs.request("r1", PROMPT))
    assert hints_of(w1.store, saves) == [None] * 3
    s2, w2, _ = engines()
    s2.add_request(openai_request("r2", {"kv_transfer_params": {"kvstore": {"retain_s": 60}}}, PROMPT[:96] + [7]))
    s2.schedule()
    assert all(r is not None and r.priority == 0 for r in hints_of(w2.store, saves))


def test_tier_saves_carry_the_hint_of_their_request(engine):
    """KVStoreTier under vLLM's OffloadingConnector: the store job's ReqContext carries
    the request's kv_transfer_params (vLLM's ReqContext has no priority)."""
    sched, tier = engine()

    def fill(job):   # stands in for the worker's GPU -> CPU copy
        for c in job.dst_spec.chunk_ids:
            tier._rows[int(c)][:] = 5

    req = openai_request("r1", {"kv_transfer_params": {"kvstore": {"retain_s": 30, "priority": 4}}}, PROMPT)
    sched.add_request(req)
    tier_base.run(sched, tier, lambda out: tier.store.stats()["blocks"] >= 3, fill)
    recs = [tier.store._hints.get(tier_base.chunk_key(tier, req, i)) for i in range(3)]
    assert all(r is not None and r.priority == 4 for r in recs)


@pytest.mark.parametrize("params, hint", [
    ({"kvstore": {"retain_s": 30}}, Hint(30)),
    ({"kvstore": {"discard": True}}, Hint(None, discard=True)),
    ({"kvstore": {"retain_s": 30, "ttl": 1}}, None),
    ({"other_connector": {"x": 1}}, None),
    (None, None),
])
def test_hint_from_a_request_context(params, hint):
    from vllm.v1.kv_offload.base import ReqContext

    from kvstore.connectors._hints import request_hint, with_hint_actions

    ctx = ReqContext("r", kv_transfer_params=params)
    assert request_hint(with_hint_actions(ctx.kv_transfer_params, ctx.kv_hints), request_id=ctx.req_id) == hint
