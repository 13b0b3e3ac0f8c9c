"""A real vLLM engine with an embedded Store (no server). It works where the scheduler and the
worker share a process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); under the CPU platform's default
``mp`` executor the worker is another process with another Store, so the connector refuses it
at start-up and names ``server``."""

from __future__ import annotations

import pytest

from tests.e2e._runner import kv_config
from tests.e2e.conftest import MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.slow

STORE = {"store": {"tiers": [{"name": "hot", "kind": "dram", "capacity": "64MiB"}]},
         "save_async": False}   # each step's saves are done when it returns: the next step can hit them


def test_embedded_store_in_one_process(engines, tiny_model, reference):
    run = engines({"model": tiny_model, "kv_transfer_config": kv_config(STORE), "steps": [
        {"prompts": PROMPTS, "max_tokens": MAX_TOKENS},
        {"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "reset_prefix_cache": True}]},
        name="embedded-uniproc", multiprocessing=False)
    res = run.result()
    assert res["start_error"] is None, res["start_error"]
    first, second = res["steps"]
    assert first.get("error") is None and second.get("error") is None, (first.get("error"), second.get("error"))
    assert first["tokens"] == reference["prompts"]
    assert second["tokens"] == reference["prompts"]
    assert second["vllm"]["vllm:external_prefix_cache_hits"] >= 1024, second["vllm"]
    assert second["connector"]["loaded_tokens"] >= 1024, second["connector"]
    assert res["alive"]


def test_embedded_store_refused_when_the_worker_is_another_process(engines, tiny_model):
    run = engines({"model": tiny_model, "kv_transfer_config": kv_config(STORE),
                   "steps": [{"prompts": PROMPTS, "max_tokens": MAX_TOKENS}]}, name="embedded-mp")
    res = run.result()
    # Refused at start-up, naming the fix (the error is raised in the engine-core process: its
    # text is in the log, the frontend sees the engine fail to start).
    assert res["start_error"] is not None, ("an embedded store was accepted with the worker in another "
                                            f"process: {res['steps']}")
    assert "server" in res["log"] and "embedded" in res["log"], res["log"][-3000:]
