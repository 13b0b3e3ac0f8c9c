"""Fixtures of the real-engine tests: the CPU engine's venv, the tiny model, the prompts and the
tokens vLLM computes for them without a connector (the reference every scenario must match)."""

from __future__ import annotations

import random

import pytest

from tests.e2e._runner import EngineRun, build_model, engine_python, skip_or_fail

BLOCK = 128          # vLLM's CPU block size
CHUNK = 256          # the connector's default chunk_tokens


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    """Two prompts sharing a 512-token prefix, with 600 tokens of their own (4 full chunks each,
    2 shared), and a batch of five sharing a 768-token prefix (the batch that found the staging
    crash). Ids 3..2047 (0-2 are the tokenizer's bos/eos/unk)."""
    r = random.Random(35)
    ids = lambda n: [r.randrange(3, 2048) for _ in range(n)]  # noqa: E731
    prefix = ids(512)
    prompts = [prefix + ids(600) for _ in range(2)]
    batch_prefix = ids(768)
    batch = [batch_prefix + ids(300 + 40 * i) for i in range(5)]
    return prompts, batch


PROMPTS, BATCH = _prompts()
MAX_TOKENS = 8


@pytest.fixture(scope="session")
def engine_py():
    py = engine_python()
    if py is None:
        skip_or_fail()
    return py


@pytest.fixture(scope="session")
def tiny_model(engine_py, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    build_model(engine_py, path)
    return str(path)


@pytest.fixture(scope="session")
def reference(engine_py, tiny_model, tmp_path_factory):
    """vLLM's tokens for PROMPTS and BATCH with no connector (its prefix cache reset between)."""
    run = EngineRun(engine_py, tmp_path_factory.mktemp("reference"), {
        "model": tiny_model, "kv_transfer_config": None,
        "steps": [{"prompts": PROMPTS, "max_tokens": MAX_TOKENS},
                  {"prompts": BATCH, "max_tokens": MAX_TOKENS, "reset_prefix_cache": True}]})
    res = run.result()
    assert res["start_error"] is None, res["start_error"]
    assert all(s["error"] is None for s in res["steps"]), res["steps"]
    prompts, batch = (s["tokens"] for s in res["steps"])
    assert all(len(t) == MAX_TOKENS for t in prompts + batch)
    return {"prompts": prompts, "batch": batch}


@pytest.fixture
def engines(tmp_path):
    """Start engine runs; every process group left is killed at the end."""
    started: list[EngineRun] = []

    def start(spec: dict, *, name: str, multiprocessing: bool = True) -> EngineRun:
        run = EngineRun(engine_python(), tmp_path, spec, multiprocessing=multiprocessing, name=name)
        started.append(run)
        return run

    yield start
    for run in started:
        run.kill()


@pytest.fixture
def servers(tmp_path):
    """Make CacheServers; every one still running is stopped at the end."""
    from tests.e2e._runner import CacheServer

    made: list[CacheServer] = []

    def make(**kwargs) -> CacheServer:
        server = CacheServer(tmp_path, name=f"serve{len(made)}", **kwargs)
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()
