"""vLLM speculative decoding with a draft model (issue 33, item 12): an EAGLE-style
draft's KV at a position depends on the token after it, so a stored chunk's draft KV at
its last position would belong to one continuation only. Confirmed with vLLM's own
proposer code and config; the connector refuses such a configuration by name at
start-up, and accepts model-free drafting (ngram). With vLLM's real classes."""

import json
from types import SimpleNamespace

import pytest
import torch

from tests import vllm_support as vs

vs.require_vllm()

from kvstore.errors import ConfigError  # noqa: E402

CHUNK = 32


def eagle_dir(root):
    """A 1-layer Llama config, the shape of an EAGLE head (vLLM reads only config.json)."""
    d = root / "tiny-eagle"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": vs.HEADS * vs.HEAD_SIZE,
        "num_attention_heads": vs.HEADS, "num_key_value_heads": vs.HEADS, "num_hidden_layers": 1,
        "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 1 << 18, "torch_dtype": "float16"}))
    return str(d)


def spec_config(vc, **kw):
    from vllm.config import SpeculativeConfig

    return SpeculativeConfig(target_model_config=vc.model_config, target_parallel_config=vc.parallel_config, **kw)


def test_an_eagle_drafts_input_at_a_chunks_last_position_is_the_next_token():
    """vLLM's EAGLE proposer feeds the draft, at position p, the token at p + 1 (and the
    sampled token at a prefill's last position): two prompts equal over a chunk but
    different after it give the draft different inputs — so different draft KV — at
    the chunk's last position. Drives vLLM's real ``set_inputs_first_pass``."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    def draft_inputs(prompt, next_token):
        n = len(prompt)
        me = SimpleNamespace(use_heterogeneous_vocab=False, needs_extra_input_slots=False, uses_mrope=False,
                             input_ids=torch.zeros(n, dtype=torch.int64), positions=torch.zeros(n, dtype=torch.int64),
                             hidden_states=torch.zeros(n, 8),
                             vllm_config=SimpleNamespace(model_config=SimpleNamespace(uses_mrope=False)))
        me._set_positions = lambda num, pos: SpecDecodeBaseProposer._set_positions(me, num, pos)
        cad = SimpleNamespace(query_start_loc=torch.tensor([0, n]))
        SpecDecodeBaseProposer.set_inputs_first_pass(
            me, torch.tensor(prompt), torch.tensor([next_token]), torch.arange(n), torch.zeros(n, 8), None, cad, None)
        return me.input_ids.tolist()

    chunk = list(range(10, 10 + CHUNK))
    a = draft_inputs(chunk + [500, 501], 600)
    b = draft_inputs(chunk + [700, 701], 600)
    assert a[:CHUNK - 1] == b[:CHUNK - 1]       # positions inside the chunk see tokens inside it
    assert a[CHUNK - 1] == 500 and b[CHUNK - 1] == 700   # the last one sees the token after the chunk


def test_vllm_itself_says_an_eagle_drafts_kv_depends_on_the_next_token(tmp_path):
    vc = vs.vllm_config(vs.model_dir(tmp_path), {})
    for method in ("eagle", "eagle3"):
        sc = spec_config(vc, method=method, model=eagle_dir(tmp_path), num_speculative_tokens=2)
        assert sc.uses_draft_kv_cache() and sc.needs_eagle_block_drop()


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model"])
@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_speculative_decoding_with_a_draft_model_is_refused_by_name(tmp_path, method, role):
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    from kvstore.connectors.vllm import KVStoreConnector

    model = vs.model_dir(tmp_path)
    vc = vs.vllm_config(model, {"store": vs.store_config(), "chunk_tokens": CHUNK})
    draft = model if method == "draft_model" else eagle_dir(tmp_path)
    vc.speculative_config = spec_config(vc, method=method, model=draft, num_speculative_tokens=2)
    with pytest.raises(ConfigError, match=rf"speculative decoding with a draft model.*{method}"):
        KVStoreConnector(vc, KVConnectorRole[role], vs.kv_cache_config(vc))


def test_model_free_drafting_is_accepted(tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    from kvstore.connectors.vllm import KVStoreConnector

    vc = vs.vllm_config(vs.model_dir(tmp_path), {"store": vs.store_config(), "chunk_tokens": CHUNK})
    vc.speculative_config = spec_config(vc, method="ngram", num_speculative_tokens=2, prompt_lookup_max=3,
                                        prompt_lookup_min=1)
    conn = KVStoreConnector(vc, KVConnectorRole.SCHEDULER, vs.kv_cache_config(vc))
    conn.shutdown()
