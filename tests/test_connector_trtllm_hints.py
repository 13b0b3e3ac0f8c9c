"""Retention hints from TensorRT-LLM (issue 22): the connector API reports each new
block's retention priority (``RequestData.priorities``, from the request's
``KvCacheRetentionConfig`` on KV cache manager V1); blocks above the default (35) are
saved with a kvstore priority hint. Against the stand-in of TensorRT-LLM's documented
connector API (TensorRT-LLM cannot be installed here)."""

import math

import pytest

from tests import test_connector_trtllm as base

standin = base.standin
trt, engine = base.trt, base.engine     # fixtures


def hints(eng, tokens):
    return [eng.scheduler.store._hints.get(k) for k in base.rank_keys(eng, tokens)]


def test_block_priorities_become_hints(engine):
    eng = engine()
    req = standin.LlmRequest(1, base.PROMPT)          # 4 full blocks and 2 tokens
    # a system prompt at 80, the user's turn at TensorRT-LLM's default and below
    eng.prefill(req, priorities=[80, 80, 35, 10, 35])
    assert eng.finish(req) is True
    recs = hints(eng, base.PROMPT)
    assert [r.priority if r else None for r in recs] == [45, 45, None, None]
    assert all(math.isinf(r.expires) for r in recs[:2])
    assert eng.scheduler.store.stats()["hints"]["given"] == 2


def test_decode_blocks_take_the_decode_priority(engine):
    eng = engine()
    req = standin.LlmRequest(1, base.PROMPT)
    eng.prefill(req)
    for token in range(1, 7):        # 24 tokens: the 6th block, allocated in decode, fills
        eng.decode(req, token, priority=90)
    eng.finish(req)
    recs = hints(eng, req.get_tokens(0))
    assert len(recs) == 6 and recs[:5] == [None] * 5
    assert recs[5] is not None and recs[5].priority == 55


@pytest.mark.parametrize("priority, want", [(None, None), (0, None), (35, None), (36, 1), (100, 65)])
def test_priority_mapping(trt, priority, want):
    hint = trt.retention_hint(priority)
    assert (hint.priority if hint else None) == want
