"""TensorRT-LLM loads never fail for staging room (issue 33, item 9): with TP>1 an offer
spans no more blocks than one worker's load staging holds, a worker's load staging is
apart from its save staging, and a load larger than it moves in staging-sized groups.
Against the stand-in of TensorRT-LLM's documented connector API (TensorRT-LLM cannot be
installed here) and a real ``kvstore serve`` for tensor parallelism."""

import importlib.util

import pytest

from tests import test_connector_trtllm as base

standin = base.standin
trt, engine, kvstore_url = base.trt, base.engine, base.kvstore_url     # fixtures
torch = base.torch
BS, LAYERS, WIDTH, PROMPT = base.BS, base.LAYERS, base.WIDTH, base.PROMPT   # 18 tokens: 4 full blocks
BLOCK_NBYTES = LAYERS * 2 * WIDTH * 2                                    # fp16, K and V

needs_server = pytest.mark.skipif(importlib.util.find_spec("kvstore.client") is None
                                  or importlib.util.find_spec("kvstore.server") is None,
                                  reason="tensor parallelism needs the kvstore cache server")


@needs_server
def test_a_tp2_offer_spans_no_more_than_a_workers_load_staging(engine, kvstore_url):
    """Four blocks are stored for both ranks; an engine whose workers have staging for
    three blocks (its load half holds one) is offered one, both ranks load it without
    raising (a four-block load raised on every rank), and the engine computes the rest."""
    seeder = engine(base.llm_args(tp=2, server_url=kvstore_url))
    first = standin.LlmRequest(1, PROMPT)
    seeder.prefill(first)
    seeder.finish(first)
    eng = engine(base.llm_args(tp=2, server_url=kvstore_url), staging_bytes=3 * BLOCK_NBYTES)
    b = standin.LlmRequest(2, PROMPT)
    assert eng.prefill(b) == 1 * BS
    for rank in (0, 1):
        for idx in range(4):
            assert torch.equal(eng.block(b, idx, rank), base.expected_block(PROMPT, idx, rank))
    eng.finish(b)
    assert eng.scheduler.store.stats()["leases"] == 0


def test_a_load_larger_than_the_load_staging_moves_in_groups(engine):
    """The worker's path without scheduler staging (each rank's own shard), handed a
    load of four blocks with load staging for one: it loads them one group after the
    other, every block the true bytes, and never raises for room."""
    from kvstore.connectors._trtllm_plan import ConnectorMeta, LoadGroup, Transfer

    eng = engine()
    a = standin.LlmRequest(1, PROMPT)
    eng.prefill(a)
    eng.finish(a)
    w = type(eng.workers[0])(base.llm_args(), rank=0, staging_bytes=3 * BLOCK_NBYTES)   # load half: one block
    pool = torch.zeros(32, LAYERS, 2, WIDTH, dtype=torch.float16)
    w.register_kv_caches(pool)
    try:
        content = [k.digest for k in eng.scheduler.scheme.content_keys(PROMPT, None)]
        w.bind_connector_meta(ConnectorMeta(loads=[LoadGroup(2, [Transfer(2, 20 + i, content[i]) for i in range(4)],
                                                             4 * BS)]))
        w.start_load_kv(None)
        w._clear_connector_meta()
        for i in range(4):
            assert torch.equal(pool[20 + i], base.expected_block(PROMPT, i, 0))
        assert w.load_staging.held_bytes <= BLOCK_NBYTES
    finally:
        w.close()
