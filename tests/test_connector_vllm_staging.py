"""A stored prefix longer than a worker's load staging is offered only what one load
can stage, and that part loads (never a load that fails on every attempt, which
vLLM's ``fail`` policy turns into a failed request). Driven by vLLM's real Scheduler
and the connector's worker hooks on real CPU caches."""

import time

import pytest
import torch

from tests import vllm_support as vs

vs.require_vllm()

from tests.test_connector_vllm_failclosed import CHUNK, PROMPT, engine, prompt_keys, run, settle, step  # noqa: E402,F401


@pytest.mark.parametrize("load_async", [False, True])
def test_a_prefix_longer_than_load_staging_is_offered_what_fits_and_loads(engine, load_async):
    s1, w1, _, f1 = engine()
    run(s1, w1, f1, vs.request("seed", PROMPT))
    assert all(w1.store.contains(prompt_keys(w1)))               # 6 chunks stored
    chunk = w1._worker.pages.chunk_bytes
    # 3 chunks of load staging (half of staging_bytes), 3 of save staging.
    s2, w2, c2, f2 = engine(policy="fail", staging_bytes=6 * chunk, load_async=load_async)
    w2._worker.in_place = False                                  # the staging path itself
    for t in c2.values():
        t.fill_(0.5)
    req = vs.request("r", PROMPT)
    s2.add_request(req)
    loads, invalid = [], set()
    deadline = time.monotonic() + 30
    while s2.has_unfinished_requests() or "r" in s2.requests:
        out, kv_out = step(s2, w2, f2)
        loads += out.kv_connector_metadata.loads
        invalid |= kv_out.invalid_block_ids or set()
        assert time.monotonic() < deadline, "request did not finish"
    settle(w2.store)
    (load,) = loads
    assert load.num_chunks == 3 and load.first_chunk == 0         # only what the load staging holds
    assert not invalid and not req.status.name.endswith("ERROR")
    stats = w2.store.stats()["connectors"]["vllm"]
    assert stats["failed_loads"] == 0
    assert stats["loaded_tokens"] == 3 * CHUNK
    assert stats["hit_tokens"] == 3 * CHUNK
    for name, t in c2.items():                                   # the loaded KV is where vLLM reads it
        assert torch.equal(t[load.block_ids], f2.truth[name][:6])
