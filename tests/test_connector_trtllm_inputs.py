"""Engine inputs and features that change a TensorRT-LLM block's KV (issue 33, items 7, 8
and 12): LoRA adapters, multimodal items and prompt-tuning tables are keyed on or
refused; a windowed pool never has blocks loaded into pages it does not have; an NVFP4
KV cache (block scales in a second pool) is refused at start-up. Against the stand-in
of TensorRT-LLM's documented connector API (TensorRT-LLM cannot be installed here)."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvstore.errors import ConfigError
from tests import test_connector_trtllm as base

standin = base.standin
trt, engine = base.trt, base.engine     # fixtures
torch = base.torch
BS, PROMPT = base.BS, base.PROMPT       # 18 tokens: 4 full blocks and 2 tokens
IMAGE_A = [11, 12, 13, 14, 15, 16, 17, 18]   # TensorRT-LLM's per-item hash: 8 int32 words
IMAGE_B = [21, 22, 23, 24, 25, 26, 27, 28]


def stored_then(eng, **request_fields):
    """Prefill and finish one request of PROMPT, so its blocks are in the store."""
    first = standin.LlmRequest(1, PROMPT, **request_fields)
    eng.prefill(first)
    eng.finish(first)


# -- item 7: LoRA, multimodal and prompt-table identity ---------------------------------


def test_two_lora_adapters_with_the_same_tokens_never_share_kv(engine):
    eng = engine()
    stored_then(eng, lora_task_id=1)
    assert all(held is None for held in eng.stored(PROMPT))      # not under the base model's keys
    assert eng.prefill(standin.LlmRequest(2, PROMPT, lora_task_id=2)) == 0
    assert eng.prefill(standin.LlmRequest(3, PROMPT)) == 0       # the base model neither
    assert eng.prefill(standin.LlmRequest(4, PROMPT, lora_task_id=1)) == 4 * BS


def test_lora_adapter_path_is_part_of_the_key(engine):
    eng = engine()
    stored_then(eng, lora_task_id=1, py_lora_path="/adapters/sql")
    assert eng.prefill(standin.LlmRequest(2, PROMPT, lora_task_id=1, py_lora_path="/adapters/chat")) == 0
    assert eng.prefill(standin.LlmRequest(3, PROMPT, lora_task_id=1, py_lora_path="/adapters/sql")) == 4 * BS


def test_request_keys_are_the_same_in_another_process(trt):
    """Keys of a LoRA and multimodal request do not depend on the process (hash seed)."""
    code = ("from kvstore.connectors._trtllm_plan import KeyScheme, RequestKey\n"
            "s = KeyScheme(model='org/tiny', dtype='float16', tokens_per_block=4, world_size=1)\n"
            "r = RequestKey(salt='t', lora='3', mm_items=((4, 'ab', 4),))\n"
            "print(','.join(k.hex() for k in s.content_keys(list(range(100, 116)), r)))\n")
    env = dict(os.environ, PYTHONPATH=os.getcwd(), PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    from kvstore.connectors._trtllm_plan import KeyScheme, RequestKey

    scheme = KeyScheme(model="org/tiny", dtype="float16", tokens_per_block=4, world_size=1)
    here = scheme.content_keys(list(range(100, 116)), RequestKey(salt="t", lora="3", mm_items=((4, "ab", 4),)))
    assert out.stdout.strip() == ",".join(k.hex() for k in here)


def test_a_salt_cannot_spell_another_requests_identity(trt):
    from kvstore.connectors._trtllm_plan import KeyScheme, RequestKey

    scheme = KeyScheme(model="org/tiny", dtype="float16", tokens_per_block=4, world_size=1)
    lora = RequestKey(salt=None, lora="5")
    forged = RequestKey(salt=lora.namespace_salt())
    assert scheme.content_keys(PROMPT, lora) != scheme.content_keys(PROMPT, forged)


def test_a_salt_only_exposed_as_cache_salt_id_still_separates(engine):
    """The C++ binding exposes ``cache_salt_id`` (an integer of the salt); a request
    carrying only that never shares blocks with an unsalted or another salt's request."""
    eng = engine()
    first = standin.LlmRequest(1, PROMPT)
    first.cache_salt_id = 77
    eng.prefill(first)
    eng.finish(first)
    assert eng.prefill(standin.LlmRequest(2, PROMPT)) == 0
    again = standin.LlmRequest(3, PROMPT)
    again.cache_salt_id = 77
    assert eng.prefill(again) == 4 * BS


def test_multimodal_items_are_keyed_by_hash_and_position(engine):
    eng = engine()
    image = dict(multimodal_hashes=[IMAGE_A], multimodal_positions=[8], multimodal_lengths=[4])
    stored_then(eng, **image)                                 # the image fills block 2
    other = dict(image, multimodal_hashes=[IMAGE_B])
    moved = dict(image, multimodal_positions=[12])    # starts in block 3: blocks 0-2 as the text-only request's
    for rid, fields, matched in ((2, other, 2), (3, {}, 2), (4, moved, 3), (5, image, 4)):
        req = standin.LlmRequest(rid, PROMPT, **fields)
        assert eng.prefill(req) == matched * BS, fields   # (2: blocks 0, 1 precede the image; 3: text only)
        eng.finish(req)


@pytest.mark.parametrize("fields", [
    dict(prompt_embedding_table="table"),                      # a prompt-tuning table (a tensor in TensorRT-LLM)
    dict(py_multimodal_data={"image": "pixels"}),              # multimodal input without item hashes
    dict(multimodal_embedding="embeddings"),
    dict(multimodal_hashes=[IMAGE_A]),                         # hashes without positions
    dict(multimodal_hashes=[IMAGE_A, IMAGE_B], multimodal_positions=[4]),
], ids=["prompt-table", "mm-data", "mm-embedding", "hash-no-position", "positions-short"])
def test_input_that_cannot_be_keyed_is_a_miss_and_saves_nothing(engine, fields):
    eng = engine()
    stored_then(eng)
    req = standin.LlmRequest(2, PROMPT, **fields)
    assert eng.prefill(req) == 0
    assert eng.last_meta.loads == [] and eng.last_meta.saves == []
    assert eng.finish(req) is False


def test_a_request_the_scheduler_never_matched_saves_nothing(engine):
    """Only ``get_num_new_matched_tokens`` sees the ``LlmRequest`` (its LoRA, its images);
    a request planned without it has an unknown identity and is not stored."""
    eng = engine()
    data = standin.RequestData(9, list(PROMPT), [0, 1, 2, 3, 4], computed_position=0,
                               num_scheduled_tokens=len(PROMPT))
    meta = eng.scheduler.build_connector_meta(standin.SchedulerOutput(new_requests=[data]))
    assert meta.saves == []


# -- item 8: attention windows ----------------------------------------------------------


def test_a_windowed_pool_offers_nothing_and_saves_nothing(engine, trt):
    store = trt.acquire_store(None)              # one embedded Store for both engines
    try:
        plain = engine()
        stored_then(plain)
        args = base.llm_args()
        args.kv_cache_config.max_attention_window = [8]
        windowed = engine(args)
        req = standin.LlmRequest(2, PROMPT)
        assert windowed.prefill(req) == 0
        assert windowed.last_meta.loads == [] and windowed.last_meta.saves == []
    finally:
        trt.release_store(store)


def test_a_window_as_long_as_the_sequence_is_no_window(trt):
    args = base.llm_args()
    args.kv_cache_config.max_attention_window = [4096]
    args.max_seq_len = 4096
    sched = trt.KVStoreConnectorScheduler(args)
    try:
        assert sched.windowed is False
    finally:
        sched.close()


@pytest.mark.parametrize("windows,max_seq_len", [([512, 4096], 4096), ([256, 1024, 1024], None)])
def test_variable_sliding_window_is_refused_by_name_at_start_up(trt, windows, max_seq_len):
    """VSWA (several window sizes: TensorRT-LLM keeps one pool per size) is refused by
    the scheduler and the worker when they are built, naming the feature."""
    args = base.llm_args()
    args.kv_cache_config.max_attention_window = windows
    args.max_seq_len = max_seq_len
    with pytest.raises(ConfigError, match=r"variable sliding window attention \(VSWA"):
        trt.KVStoreConnectorScheduler(args)
    with pytest.raises(ConfigError, match="VSWA"):
        trt.KVStoreConnectorWorker(args)


def test_one_window_size_for_every_layer_is_not_vswa(trt):
    for windows, max_seq_len in (([512, 512], 4096), ([4096, 8192], 4096)):
        args = base.llm_args()
        args.kv_cache_config.max_attention_window = windows
        args.max_seq_len = max_seq_len
        sched = trt.KVStoreConnectorScheduler(args)
        try:
            assert sched.windowed is (windows == [512, 512])
        finally:
            sched.close()


def test_blocks_a_window_has_passed_are_never_load_targets(engine):
    """The engine reports the leading blocks as -1 (its window has passed them): the
    in-window blocks of the promised range are loaded, none into a -1, and from then
    on the pool is treated as windowed (nothing offered, nothing saved)."""
    eng = engine()
    stored_then(eng)
    sched, worker = eng.scheduler, eng.workers[0]
    req = standin.LlmRequest(2, PROMPT)
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * BS, False)
    ids = [-1, -1, 20, 21, 22]
    sched.update_state_after_alloc(req, ids)
    data = standin.RequestData(2, list(PROMPT), ids, computed_position=0, num_scheduled_tokens=len(PROMPT) - 4 * BS)
    meta = sched.build_connector_meta(standin.SchedulerOutput(new_requests=[data]))
    assert base.loaded_ids(meta) == [20, 21]
    assert meta.saves == []
    eng.pools[0].fill_(7)
    worker.bind_connector_meta(meta)
    worker.start_load_kv(None)
    for block_id, idx in ((20, 2), (21, 3)):
        assert torch.equal(eng.pools[0][block_id], base.expected_block(PROMPT, idx, 0))
    worker._clear_connector_meta()
    from kvstore.connectors._trtllm_plan import LOCAL

    assert not LOCAL._tickets                     # the staged blocks 0, 1 went back
    sched.request_finished(req, ids)
    assert sched.get_num_new_matched_tokens(standin.LlmRequest(3, PROMPT), 0) == (0, False)
    assert sched.store.stats()["leases"] == 0


# -- item 12: NVFP4's block-scale pool --------------------------------------------------


@pytest.mark.parametrize("where", ["kv_dtype", "kv_cache_quant_algo"])
def test_nvfp4_kv_is_refused_at_start_up(trt, where):
    """An NVFP4 KV cache keeps per-block scales in a second pool; the connector is handed
    (and moves) only the primary pool, so loaded blocks would be read with another
    block's scales. Refused by name, for the scheduler and the worker."""
    args = base.llm_args(kv_dtype="nvfp4" if where == "kv_dtype" else "auto")
    if where == "kv_cache_quant_algo":
        args.quant_config.kv_cache_quant_algo = "NVFP4"
    with pytest.raises(ConfigError, match="NVFP4"):
        trt.KVStoreConnectorScheduler(args)
    with pytest.raises(ConfigError, match="NVFP4"):
        trt.KVStoreConnectorWorker(args, rank=0)


def test_a_layout_with_a_second_pool_is_refused(trt):
    worker = trt.KVStoreConnectorWorker(base.llm_args(), rank=0)
    try:
        def region(t):
            return SimpleNamespace(as_tensor=lambda dtype=None: t)

        pool = torch.zeros(8, base.LAYERS, 2, base.WIDTH, dtype=torch.float16)
        scales = torch.zeros(8, base.LAYERS, 2, 4, dtype=torch.uint8)
        with pytest.raises(ConfigError, match="block-scale"):
            worker.register_kv_cache_layout(SimpleNamespace(groups=[SimpleNamespace(regions=[region(pool),
                                                                                           region(scales)])]))
        worker.register_kv_cache_layout(SimpleNamespace(groups=[SimpleNamespace(regions=[region(pool)])]))
        assert worker.layout.block_shape == (base.LAYERS, 2, base.WIDTH)
    finally:
        worker.close()


@pytest.mark.parametrize("config", ["MTPDecodingConfig", "EagleDecodingConfig", "DraftTargetDecodingConfig"])
@pytest.mark.parametrize("side", ["scheduler", "worker"])
def test_speculative_decoding_with_a_draft_model_is_refused_at_start_up(trt, config, side):
    """Issue 33 item 12: an MTP / EAGLE draft's KV at a block's last position depends on
    the next token, and one-model drafts keep it in the pool the connector moves."""
    args = base.llm_args()
    args.speculative_config = getattr(standin, config)()
    cls = trt.KVStoreConnectorScheduler if side == "scheduler" else trt.KVStoreConnectorWorker
    kw = {} if side == "scheduler" else {"rank": 0}
    with pytest.raises(ConfigError, match="speculative decoding with a draft model"):
        cls(args, **kw)


def test_ngram_speculative_decoding_is_accepted(engine):
    args = base.llm_args()
    args.speculative_config = standin.NGramDecodingConfig()
    eng = engine(args)
    a = standin.LlmRequest(1, PROMPT)
    eng.prefill(a)
    eng.finish(a)
