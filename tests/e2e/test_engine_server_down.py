"""A real vLLM engine whose cache server is not there when it starts: one that was stopped before
the run and comes back, and an address where no server ever was. The engine starts, every
request is a miss with identical tokens, and the engine lives on."""

from __future__ import annotations

import pytest

from tests.e2e._runner import kv_config
from tests.e2e.conftest import MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.slow

RETRY = {"tries": 8, "sleep_s": 2.0}


def _steps(res: dict) -> list[dict]:
    assert res["start_error"] is None, f"the engine did not start:\n{res['start_error']}\n{res['log'][-3000:]}"
    assert all(s.get("error") is None for s in res["steps"]), [s.get("error") for s in res["steps"]]
    return res["steps"]


def test_server_stopped_before_the_run_then_started(engines, servers, tiny_model, reference):
    server = servers().start()
    server.stop()
    run = engines({"model": tiny_model, "kv_transfer_config": kv_config({"server": server.address}), "steps": [
        {"prompts": PROMPTS, "max_tokens": MAX_TOKENS},
        {"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "reset_prefix_cache": True, "pause": "up",
         "until_hit": RETRY}]}, name="down-then-up")
    try:
        run.at("up")
        server.start()
    finally:
        run.go("up")
    res = run.result()
    down, up = _steps(res)
    assert down["tokens"] == reference["prompts"]
    assert down["vllm"]["vllm:external_prefix_cache_hits"] == 0
    # Once the server is up the engine reaches it: saves land, and a later try hits them.
    assert all(t["tokens"] == reference["prompts"] for t in up["tries"])
    assert up["vllm"]["vllm:external_prefix_cache_hits"] > 0, [t["vllm"] for t in up["tries"]]
    assert res["alive"], res.get("probe_error")


def test_server_that_was_never_there(engines, tiny_model, reference):
    """No server ever listened there, under vLLM's default ``fail`` policy: a miss is not a
    failed load, so no request fails."""
    from kvstore.testing import free_port

    address = f"127.0.0.1:{free_port()}"
    run = engines({"model": tiny_model, "kv_transfer_config": kv_config({"server": address}, policy="fail"),
                   "steps": [{"prompts": PROMPTS, "max_tokens": MAX_TOKENS},
                             {"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "reset_prefix_cache": True}]},
                  name="never-there")
    res = run.result()
    for step in _steps(res):
        assert step["tokens"] == reference["prompts"]
        assert step["finish"] == ["length", "length"]
        assert step["vllm"]["vllm:external_prefix_cache_hits"] == 0
        assert step["connector"]["loaded_tokens"] == 0
    assert res["alive"], res.get("probe_error")
