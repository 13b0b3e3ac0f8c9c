"""vLLM connector costs, measured against plain torch in the same run.

1. Scheduler side: per request, hashing a prompt's chunk keys once (``on_new_request``)
   and answering ``get_num_new_matched_tokens`` (a store lookup of every chunk), for
   1K, 32K and 128K-token prompts that are fully cached.
2. Scheduler steps: vLLM's real ``Scheduler`` with 1, 8 and 64 requests of 32K tokens,
   fully cached, embedded and through a cache server: the time per step spent in
   ``get_num_new_matched_tokens`` + ``update_state_after_alloc`` + ``build_connector_meta``
   (the admission step, and decode steps), beside vLLM's own ``schedule()`` +
   ``update_from_output`` for the same requests without a connector (the baseline).
3. Worker side: saving and loading paged KV blocks of real vLLM CPU caches through the
   connector's hooks (gather + store copy; store copy + scatter) vs a plain torch
   ``index_select`` / ``index_copy_`` of the same blocks into / out of one host buffer.
   For async saves, also the time the step is blocked (the store copy runs behind).

Usage: ``python benchmarks/vllm_connector.py [--quick]``; writes
``benchmarks/results/vllm_connector.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import median_time, print_table, write_json  # noqa: E402
from tests import vllm_support as vs  # noqa: E402

CHUNK = 256



def bench_lookup(model: str, reps: int) -> list[dict]:
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    from kvstore.connectors.vllm import KVStoreConnector

    rows = []
    for n in (1024, 32768, 131072):
        extra = {"store": vs.store_config("256MiB", name=f"b{uuid.uuid4().hex[:8]}"), "chunk_tokens": CHUNK}
        vc = vs.vllm_config(model, extra, max_model_len=n + 1024)
        conn = KVStoreConnector(vc, KVConnectorRole.SCHEDULER, vs.kv_cache_config(vc))
        rng = np.random.default_rng(n)
        tokens = rng.integers(0, 900, n + 1).tolist()
        req = vs.request("warm", tokens)
        conn.on_new_request(req)
        keys = conn._scheduler._reqs["warm"].keys[0]
        conn.store.save(keys, [np.zeros(64, np.uint8)] * len(keys)).result()
        ids = iter(range(10**9))

        def hash_keys():
            r = vs.request(f"h{next(ids)}", tokens)
            t = time.perf_counter()
            conn.on_new_request(r)
            return time.perf_counter() - t

        hashing = statistics.median(hash_keys() for _ in range(3 * reps))
        lookup = median_time(lambda: conn.get_num_new_matched_tokens(req, 0), repeat=reps * 10)
        hit, _ = conn.get_num_new_matched_tokens(req, 0)
        assert hit == len(keys) * CHUNK
        rows.append({"prompt_tokens": n, "chunks": len(keys), "hash_keys_ms": hashing * 1e3,
                     "lookup_ms": lookup * 1e3, "hit_tokens": hit})
        conn.shutdown()
    return rows


STEP_TOKENS = 32768
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta")


def _step_scheduler(model: str, n: int, extra: dict | None):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    mc = ModelConfig(model=model, skip_tokenizer_init=True, max_model_len=STEP_TOKENS + 64, dtype="float16")
    cc = CacheConfig(block_size=vs.BLOCK, enable_prefix_caching=True)
    cc.kv_cache_layout = "LBHNC"
    sc = SchedulerConfig(max_num_seqs=max(n, 2), max_num_batched_tokens=65536, max_model_len=STEP_TOKENS + 64,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    kt = None if extra is None else KVTransferConfig(
        kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.connectors.vllm", kv_role="kv_both",
        kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
    vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, device_config=DeviceConfig("cpu"),
                    kv_transfer_config=kt)
    return vs.scheduler(vc, vs.kv_cache_config(vc, num_blocks=n * (STEP_TOKENS // vs.BLOCK + 8)))


def bench_steps(model: str, n: int, reps: int, extra: dict | None) -> dict:
    """Per-step time in the connector's scheduler hooks (or, with ``extra`` None, vLLM's
    whole step without a connector) for ``n`` fully cached 32K-token requests."""
    sched = _step_scheduler(model, n, extra)
    conn = sched.connector
    spent = [0.0]
    if conn is not None:
        for name in HOOKS:
            inner = getattr(conn, name)

            def timed(*args, _inner=inner, **kwargs):
                t = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    spent[0] += time.perf_counter() - t
            setattr(conn, name, timed)
    rng = np.random.default_rng(n)
    reqs = [vs.request(f"r{i}", rng.integers(0, 900, STEP_TOKENS).tolist(), max_tokens=10**6) for i in range(n)]
    if conn is not None:      # the store holds every chunk (tiny stand-in blocks: lookups only)
        for r in reqs:
            conn.on_new_request(r)
            keys = conn._scheduler._reqs[r.request_id].keys[0]
            conn.store.save(keys, [np.zeros(64, np.uint8)] * len(keys)).result()

    def one_step() -> float:
        spent[0] = 0.0
        t = time.perf_counter()
        out = sched.schedule()
        sched.update_from_output(out, vs.model_output(out))
        return spent[0] if conn is not None else time.perf_counter() - t

    for r in reqs:
        sched.add_request(r)
    admission = one_step()
    while len(sched.running) < n or any(r.num_computed_tokens < STEP_TOKENS for r in sched.running):
        one_step()
    for _ in range(3):
        one_step()
    decode = statistics.median(one_step() for _ in range(reps * 5))
    if conn is not None:
        conn.shutdown()
    return {"requests": n, "admission_ms": admission * 1e3, "decode_ms": decode * 1e3}


def bench_worker(model: str, layout: str, reps: int, quick: bool) -> dict:
    from kvstore.connectors._vllm_meta import ChunkTransfer, KVStoreConnectorMetadata

    layers, heads, head_size = (4, 8, 128) if quick else (8, 8, 128)
    num_blocks, n_chunks = 192, 8
    per_chunk = CHUNK // vs.BLOCK
    extra = {"store": vs.store_config("512MiB", name=f"b{uuid.uuid4().hex[:8]}"), "chunk_tokens": CHUNK,
             "save_async": False}
    vc = vs.vllm_config(model, extra, layout=layout)
    kcc = vs.kv_cache_config(vc, num_blocks, layers=layers, heads=heads, head_size=head_size)
    caches = vs.kv_caches(kcc, layout, seed=1)
    worker = vs.worker_connector(vc, kcc)
    worker.register_kv_caches(caches)
    inner = worker._worker
    ids = torch.randperm(num_blocks - 1)[: n_chunks * per_chunk] + 1
    block_ids = ids.view(n_chunks, per_chunk).tolist()
    nbytes = n_chunks * inner.pages.chunk_bytes

    # Baseline: one index op per layer into / out of one preallocated host buffer.
    tensors = list(caches.values())
    staging = [torch.empty((ids.numel(), *t.shape[1:]), dtype=t.dtype) for t in tensors]

    def raw_save():
        for t, s in zip(tensors, staging):
            torch.index_select(t, 0, ids, out=s)

    def raw_load():
        for t, s in zip(tensors, staging):
            t.index_copy_(0, ids, s)

    ns = worker.shape.namespace(0, "bench")
    counter = iter(range(10**9))

    def fresh_keys():
        start = next(counter) * n_chunks * CHUNK
        return ns.chunk_keys(np.arange(start, start + n_chunks * CHUNK, dtype=np.uint32))

    def conn_save(keys=None, *, async_=False):
        keys = keys or fresh_keys()
        meta = KVStoreConnectorMetadata(saves=[ChunkTransfer("s", [keys], block_ids)])
        worker.bind_connector_metadata(meta)
        inner.config = inner.config.model_copy(update={"save_async": async_})
        t = time.perf_counter()
        worker.wait_for_save()
        blocked = time.perf_counter() - t
        for f in inner.saves.futures.pop("s", []):
            f.result()
        took = time.perf_counter() - t
        worker.clear_connector_metadata()
        return keys, blocked, took

    stored, _, _ = conn_save()

    def conn_load():
        meta = KVStoreConnectorMetadata(loads=[ChunkTransfer("l", [stored], block_ids)])
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        errors = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        assert not errors, errors

    def save_sync():
        keys, _, took = conn_save()
        worker.store.delete(keys)      # keep the store's footprint flat between rounds
        time.sleep(0.02)               # staging buffers come back from store threads (steady state)
        return took

    def async_blocked():
        keys, blocked, _ = conn_save(async_=True)
        worker.store.delete(keys)
        time.sleep(0.02)
        return blocked

    # Interleaved rounds: this VM is shared, so compare each connector run with the raw
    # run next to it and report the median of the per-round ratios.
    rounds = {k: [] for k in ("raw_s", "con_s", "blocked", "raw_l", "con_l")}
    for fn in (raw_save, save_sync, raw_load, conn_load, async_blocked):
        fn()
    for _ in range(reps):
        for key, fn in (("raw_s", raw_save), ("con_s", save_sync), ("blocked", async_blocked),
                        ("raw_l", raw_load), ("con_l", conn_load)):
            t = time.perf_counter()
            got = fn()
            rounds[key].append(got if key in ("con_s", "blocked") else time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in rounds.items()}
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(rounds[a], rounds[b])) - 1  # noqa: E731
    raw_s, con_s, blocked, raw_l, con_l = (med[k] for k in ("raw_s", "con_s", "blocked", "raw_l", "con_l"))
    worker.shutdown()
    gbs = lambda s: nbytes / s / 1e9  # noqa: E731
    return {"layout": layout, "layers": layers, "blocks": int(ids.numel()), "chunks": n_chunks,
            "bytes": nbytes, "single_op": inner.pages.single_op,
            "raw_save_gbs": gbs(raw_s), "connector_save_gbs": gbs(con_s),
            "connector_save_step_blocked_gbs": gbs(blocked),
            "raw_load_gbs": gbs(raw_l), "connector_load_gbs": gbs(con_l),
            "save_overhead": ratio("con_s", "raw_s"), "save_step_overhead": ratio("blocked", "raw_s"),
            "load_overhead": ratio("con_l", "raw_l")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller caches, fewer repetitions")
    parser.add_argument("--name", default="vllm_connector", help="result file benchmarks/results/NAME.json")
    args = parser.parse_args()
    vs.require_vllm()
    reps = 3 if args.quick else 7
    with tempfile.TemporaryDirectory() as tmp:
        model = vs.model_dir(Path(tmp))
        lookup = bench_lookup(model, reps)
        steps = []
        from tests._servers import ProcessServer, config_dict

        server = ProcessServer(config_dict("1GiB"), Path(tmp))
        try:
            for n in (1, 8, 64):
                base = bench_steps(model, n, reps, None)
                emb = bench_steps(model, n, reps, {"store": vs.store_config("1GiB", name=f"s{n}"),
                                                   "chunk_tokens": CHUNK})
                srv = bench_steps(model, n, reps, {"server": server.address, "chunk_tokens": CHUNK})
                steps.append({"requests": n, "vllm_step_admission_ms": base["admission_ms"],
                              "vllm_step_decode_ms": base["decode_ms"],
                              "embedded_admission_ms": emb["admission_ms"], "embedded_decode_ms": emb["decode_ms"],
                              "server_admission_ms": srv["admission_ms"], "server_decode_ms": srv["decode_ms"]})
        finally:
            server.kill()
        worker = [bench_worker(model, layout, reps, args.quick) for layout in ("LBHNC", "BLHNC", "LHBNC")]

    print(f"\nScheduler side ({CHUNK}-token chunks, prompt fully cached)")
    print_table(["prompt tokens", "chunks", "hash keys, once (ms)", "lookup (ms)"],
                [[r["prompt_tokens"], r["chunks"], r["hash_keys_ms"], r["lookup_ms"]] for r in lookup])
    print(f"\nScheduler steps, {STEP_TOKENS}-token requests fully cached: ms per step in the connector's "
          "hooks; baseline = vLLM's own schedule() + update_from_output() without a connector")
    print_table(["requests", "vLLM step: admit", "vLLM step: decode", "embedded: admit", "embedded: decode",
                 "server: admit", "server: decode"],
                [[r["requests"], r["vllm_step_admission_ms"], r["vllm_step_decode_ms"], r["embedded_admission_ms"],
                  r["embedded_decode_ms"], r["server_admission_ms"], r["server_decode_ms"]] for r in steps])
    print("\nWorker side, GB/s; raw = plain torch index_select / index_copy_ of the same blocks")
    print_table(["layout", "MiB", "raw save", "conn save", "save blocked*", "raw load", "conn load",
                 "save ovh", "blocked ovh", "load ovh"],
                [[r["layout"], r["bytes"] >> 20, r["raw_save_gbs"], r["connector_save_gbs"],
                  r["connector_save_step_blocked_gbs"], r["raw_load_gbs"], r["connector_load_gbs"],
                  f"{r['save_overhead']:+.0%}", f"{r['save_step_overhead']:+.0%}", f"{r['load_overhead']:+.0%}"]
                 for r in worker])
    print("* save_async: what the step waits for (host caches: the gather straight into store slots)")
    path = write_json(args.name, {"chunk_tokens": CHUNK, "lookup": lookup, "steps": steps, "worker": worker,
                                  "torch_threads": torch.get_num_threads(), "quick": args.quick})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
