"""End-to-end proof with a real transformer: time to first token when the prompt's KV
is recomputed vs loaded from kvstore, with identical generated tokens.

The model is a Hugging Face ``LlamaForCausalLM`` built locally from a config with
random weights (no download). Its KV cache is saved chunk by chunk under the prompt's
content-addressed keys and loaded back into a ``DynamicCache``.

Both paths do the same arithmetic on the last chunk: the prompt is split at the last
chunk boundary before its final token (``split``). Recompute prefills ``[0, split)``
and then ``[split, P)``; load fetches ``[0, split)`` from the store and prefills
``[split, P)``. So the bytes in the cache are bit-identical (they are the recomputed
bytes), the last step runs the same kernels on the same inputs, and greedy decoding
must produce the same tokens: any difference means the store returned wrong KV.

Block layout (one block per chunk): ``[layers, 2 (K, V), kv_heads, chunk_tokens,
head_dim]`` in the model's dtype, C-contiguous. ``transformers`` is imported lazily.
Nothing here is thread-safe: one model, one caller.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey, Namespace

# Llama shapes. "small" is the benchmark model: big enough that prefill is real
# compute (~60M parameters), small enough that a 16K-token CPU prefill on 2 cores
# finishes in about a minute. "medium" (~200M) is for GPUs. "tiny" is for tests.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=32000),
    "medium": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                   num_key_value_heads=4, vocab_size=32000),
}


class KVBackend(Protocol):
    """What the demo needs from a Store or a remote Client."""

    def lookup(self, keys: Sequence[BlockKey], lease_s: float | None = None) -> int: ...
    def save(self, keys: Sequence[BlockKey], srcs: Sequence[Any]) -> Any: ...
    def load(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> Any: ...


def require_transformers():
    """Import ``transformers`` or explain how to get it."""
    try:
        import transformers
    except ImportError as exc:
        raise KVStoreError("the end-to-end demo needs Hugging Face transformers: "
                           "pip install 'transformers>=5.16,<5.21' (keep your torch: add --no-deps "
                           "plus tokenizers safetensors huggingface_hub regex if pip wants to upgrade it)") from exc
    return transformers


def build_model(size: str = "small", *, device: Any = "cpu", dtype: Any = None, seed: int = 0,
                max_positions: int = 32768):
    """A randomly initialised Llama of ``MODEL_SIZES[size]`` in eval mode on ``device``."""
    import torch

    transformers = require_transformers()
    if size not in MODEL_SIZES:
        raise KVStoreError(f"unknown model size {size!r}; choose one of {sorted(MODEL_SIZES)}")
    cfg = transformers.LlamaConfig(**MODEL_SIZES[size], max_position_embeddings=max_positions,
                                   tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    return model.to(device=device, dtype=dtype or torch.float32).eval()


@dataclass(frozen=True)
class KVLayout:
    """Shape of one stored block, from the model config."""

    layers: int
    kv_heads: int
    head_dim: int
    chunk_tokens: int
    dtype: Any

    @classmethod
    def of(cls, model, chunk_tokens: int) -> "KVLayout":
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(c.num_hidden_layers, c.num_key_value_heads, head_dim, chunk_tokens, model.dtype)

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.layers, 2, self.kv_heads, self.chunk_tokens, self.head_dim)

    @property
    def block_bytes(self) -> int:
        import torch

        return int(np.prod(self.block_shape)) * torch.empty(0, dtype=self.dtype).element_size()

    def namespace(self, model_id: str) -> Namespace:
        return Namespace(model=model_id, dtype=str(self.dtype).removeprefix("torch."),
                         chunk_tokens=self.chunk_tokens,
                         layout=f"llama:L{self.layers}:H{self.kv_heads}:D{self.head_dim}:LKHCD")

    def split(self, prompt_len: int) -> int:
        """Tokens whose KV is cacheable: whole chunks, leaving at least the last token."""
        return (prompt_len - 1) // self.chunk_tokens * self.chunk_tokens


def cache_to_blocks(cache, layout: KVLayout, n_chunks: int):
    """The first ``n_chunks`` chunks of a ``DynamicCache`` as one contiguous tensor
    ``[n_chunks, *layout.block_shape]`` (a copy; row ``i`` is block ``i``)."""
    import torch

    t = n_chunks * layout.chunk_tokens
    kv = torch.stack([torch.stack([lay.keys[0, :, :t], lay.values[0, :, :t]]) for lay in cache.layers])
    kv = kv.view(layout.layers, 2, layout.kv_heads, n_chunks, layout.chunk_tokens, layout.head_dim)
    return kv.permute(3, 0, 1, 2, 4, 5).contiguous()


def blocks_to_cache(blocks, layout: KVLayout):
    """A ``DynamicCache`` holding the KV of ``blocks`` (``[n, *block_shape]``), in order."""
    transformers = require_transformers()
    n = blocks.shape[0]
    t = n * layout.chunk_tokens
    cache = transformers.DynamicCache()
    for layer in range(layout.layers):
        k = blocks[:, layer, 0].permute(1, 0, 2, 3).reshape(1, layout.kv_heads, t, layout.head_dim)
        v = blocks[:, layer, 1].permute(1, 0, 2, 3).reshape(1, layout.kv_heads, t, layout.head_dim)
        cache.update(k, v, layer)
    return cache


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def prefill(model, cache, ids, start: int) -> None:
    """Run ``ids`` (``[1, n]``) through the decoder at positions ``start..`` to fill
    ``cache``; no logits (an engine's prefill of cached-to-be tokens needs none)."""
    import torch

    pos = torch.arange(start, start + ids.shape[1], device=ids.device)
    model.model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=pos)


def greedy(model, cache, ids, start: int, new_tokens: int) -> tuple[list[int], float]:
    """Feed ``ids`` at ``start`` then decode greedily. Returns the tokens and the
    ``perf_counter`` time at which the first one was known."""
    import torch

    out: list[int] = []
    first = 0.0
    pos = start
    for i in range(new_tokens):
        cp = torch.arange(pos, pos + ids.shape[1], device=ids.device)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=cp,
                       logits_to_keep=1).logits[:, -1]
        tok = logits.argmax(-1)
        out.append(int(tok))  # int() waits for the device: the token is known now
        if i == 0:
            first = time.perf_counter()
        pos += ids.shape[1]
        ids = tok.view(1, 1)
    return out, first


@dataclass
class Run:
    """One request: generated tokens, time to first token, time for all tokens, parts."""

    tokens: list[int]
    ttft_s: float
    total_s: float
    parts: dict[str, float] = field(default_factory=dict)
    cached_tokens: int = 0


def run_recompute(model, prompt, layout: KVLayout, new_tokens: int) -> tuple[Run, Any]:
    """Prefill the whole prompt and decode. Returns the run and its cache (whose first
    ``layout.split(P)`` tokens are what a store would hold for this prompt)."""
    import torch

    transformers = require_transformers()
    split = layout.split(prompt.shape[1])
    with torch.inference_mode():
        t0 = time.perf_counter()
        cache = transformers.DynamicCache()
        if split:
            prefill(model, cache, prompt[:, :split], 0)
        tokens, first = greedy(model, cache, prompt[:, split:], split, new_tokens)
        _sync(prompt.device)
        end = time.perf_counter()
    return Run(tokens, first - t0, end - t0), cache


def save_prompt(backend: KVBackend, ns: Namespace, prompt, cache, layout: KVLayout) -> int:
    """Store the cacheable chunks of a recomputed prompt; returns how many were stored."""
    split = layout.split(prompt.shape[1])
    keys = ns.chunk_keys(prompt[0, :split])
    if not keys:
        return 0
    blocks = cache_to_blocks(cache, layout, len(keys))
    return sum(backend.save(keys, list(blocks.unbind(0))).result())


def run_load(model, backend: KVBackend, ns: Namespace, prompt, layout: KVLayout, new_tokens: int,
             scratch=None) -> Run:
    """Fetch the prompt's cached prefix from ``backend`` into ``scratch`` (a reusable
    ``[n, *block_shape]`` tensor on the model's device, as an engine's preallocated KV
    pool would be; allocated here when ``None``), prefill what is left, decode."""
    import torch

    split = layout.split(prompt.shape[1])
    parts: dict[str, float] = {}
    with torch.inference_mode():
        t0 = time.perf_counter()
        keys = ns.chunk_keys(prompt[0, :split])
        n = backend.lookup(keys, lease_s=30.0) if keys else 0
        t1 = time.perf_counter()
        if scratch is None or scratch.shape[0] < n:
            scratch = torch.empty((n, *layout.block_shape), dtype=layout.dtype, device=prompt.device)
        blocks = scratch[:n]
        got = backend.load(keys[:n], list(blocks.unbind(0))).result() if n else []
        n = next((i for i, ok in enumerate(got) if not ok), n)  # use the verified prefix only
        t2 = time.perf_counter()
        cache = blocks_to_cache(blocks[:n], layout) if n else require_transformers().DynamicCache()
        hit = n * layout.chunk_tokens
        if hit < split:
            prefill(model, cache, prompt[:, hit:split], hit)
        t3 = time.perf_counter()
        tokens, first = greedy(model, cache, prompt[:, split:], split, new_tokens)
        _sync(prompt.device)
        end = time.perf_counter()
    parts.update(lookup_s=t1 - t0, load_s=t2 - t1, build_s=t3 - t2, last_chunk_s=first - t3)
    return Run(tokens, first - t0, end - t0, parts, cached_tokens=hit)


def make_prompt(length: int, vocab: int, *, seed: int, device: Any = "cpu"):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, length), generator=g).to(device)


def warm_up(model, device: Any) -> None:
    """One short forward so one-off kernel set-up is not charged to the first run."""
    import torch

    transformers = require_transformers()
    with torch.inference_mode():
        ids = make_prompt(64, model.config.vocab_size, seed=12345, device=device)
        greedy(model, transformers.DynamicCache(), ids, 0, 2)
