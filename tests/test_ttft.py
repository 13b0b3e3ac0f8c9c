"""End-to-end with a real (tiny, random-weight) Llama: generation from KV loaded out of
kvstore is token-for-token the generation from recomputed KV."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvstore import _ttft as T  # noqa: E402
from kvstore.store import Store  # noqa: E402

CHUNK = 16
NEW = 32


@pytest.fixture(scope="module")
def model():
    return T.build_model("tiny", seed=1)


@pytest.fixture
def store():
    with Store.from_config({"tiers": [{"name": "ram", "kind": "dram", "capacity": "64MiB"}]}) as s:
        yield s


@pytest.mark.parametrize("length", [16, 100, 160])
def test_loaded_kv_generates_identical_tokens(model, store, length):
    layout = T.KVLayout.of(model, CHUNK)
    ns = layout.namespace("tiny-test")
    prompt = T.make_prompt(length, model.config.vocab_size, seed=length)
    ref, cache = T.run_recompute(model, prompt, layout, NEW)
    saved = T.save_prompt(store, ns, prompt, cache, layout)
    assert saved == layout.split(length) // CHUNK
    got = T.run_load(model, store, ns, prompt, layout, NEW)
    assert got.cached_tokens == layout.split(length)
    assert len(ref.tokens) == NEW
    assert got.tokens == ref.tokens


def test_store_returns_the_recomputed_kv_bytes(model, store):
    layout = T.KVLayout.of(model, CHUNK)
    ns = layout.namespace("tiny-test")
    prompt = T.make_prompt(128, model.config.vocab_size, seed=7)
    _, cache = T.run_recompute(model, prompt, layout, 1)
    T.save_prompt(store, ns, prompt, cache, layout)
    keys = ns.chunk_keys(prompt[0, :layout.split(128)])
    blocks = torch.empty((len(keys), *layout.block_shape))
    assert all(store.load(keys, list(blocks.unbind(0))).result())
    rebuilt = T.blocks_to_cache(blocks, layout)
    t = len(keys) * CHUNK
    for lay, ref in zip(rebuilt.layers, cache.layers):
        assert torch.equal(lay.keys, ref.keys[:, :, :t]) and torch.equal(lay.values, ref.values[:, :, :t])


def _load_with_foreign_blocks(model, store, prompt, blocks, layout):
    ns = layout.namespace("tiny-foreign")
    keys = ns.chunk_keys(prompt[0, :layout.split(prompt.shape[1])])
    assert all(store.save(keys, list(blocks[:len(keys)].unbind(0))).result())
    return T.run_load(model, store, ns, prompt, layout, NEW)


def test_kv_at_the_wrong_positions_changes_the_output(model, store):
    """The identity check can fail: the same tokens' KV computed one chunk further
    along (different rotary positions) yields different generated tokens."""
    layout = T.KVLayout.of(model, CHUNK)
    prompt = T.make_prompt(160, model.config.vocab_size, seed=3)
    ref, _ = T.run_recompute(model, prompt, layout, NEW)
    shifted = torch.cat([T.make_prompt(CHUNK, model.config.vocab_size, seed=99), prompt], 1)
    _, cache = T.run_recompute(model, shifted, layout, 1)
    blocks = T.cache_to_blocks(cache, layout, 1 + layout.split(160) // CHUNK)[1:]
    got = _load_with_foreign_blocks(model, store, prompt, blocks, layout)
    assert got.cached_tokens == layout.split(160)
    assert got.tokens != ref.tokens


def test_kv_of_another_prompt_changes_the_output(model, store):
    layout = T.KVLayout.of(model, CHUNK)
    prompt = T.make_prompt(160, model.config.vocab_size, seed=3)
    ref, _ = T.run_recompute(model, prompt, layout, NEW)
    _, cache = T.run_recompute(model, T.make_prompt(160, model.config.vocab_size, seed=5), layout, 1)
    got = _load_with_foreign_blocks(model, store, prompt, T.cache_to_blocks(cache, layout, 9), layout)
    assert got.tokens != ref.tokens


def test_partial_hit_recomputes_the_rest(model, store):
    layout = T.KVLayout.of(model, CHUNK)
    ns = layout.namespace("tiny-partial")
    prompt = T.make_prompt(160, model.config.vocab_size, seed=4)
    ref, cache = T.run_recompute(model, prompt, layout, NEW)
    keys = ns.chunk_keys(prompt[0, :layout.split(160)])
    blocks = T.cache_to_blocks(cache, layout, len(keys))
    assert all(store.save(keys[:3], list(blocks[:3].unbind(0))).result())
    got = T.run_load(model, store, ns, prompt, layout, NEW)
    assert got.cached_tokens == 3 * CHUNK
    assert got.tokens == ref.tokens


def test_demo_command(capsys):
    from kvstore.cli import main

    rc = main(["demo", "--model", "tiny", "--tokens", "96", "--chunk-tokens", "16", "--new-tokens", "8"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "generated tokens identical: yes" in out and "5 blocks of 16 tokens" in out


def test_demo_rejects_a_prompt_shorter_than_two_chunks(capsys):
    from kvstore.cli import main

    assert main(["demo", "--model", "tiny", "--tokens", "20", "--chunk-tokens", "16"]) == 2
    assert "--tokens must be at least" in capsys.readouterr().err


def test_demo_without_cuda_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    from kvstore.cli import main

    assert main(["demo", "--model", "tiny", "--tokens", "64", "--chunk-tokens", "16", "--device", "cuda:0"]) == 2
    assert "needs CUDA" in capsys.readouterr().err
