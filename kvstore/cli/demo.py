"""``kvstore demo``: a real (random-weight) Llama answers one prompt twice, recomputing
its prefill and loading the prompt's KV from a Store, and shows that loading is faster
and changes nothing in the generated tokens. The full sweep is benchmarks/ttft.py."""

from __future__ import annotations

import argparse

from tqdm import tqdm

from kvstore._extras import install_hint
from kvstore.errors import KVStoreError


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="show TTFT with and without cached KV on a real transformer")
    parser.add_argument("--config", help="Store config to load from (default: 1 GiB of DRAM)")
    parser.add_argument("--model", default="small", help="model size: tiny, small or medium (default small)")
    parser.add_argument("--tokens", type=int, default=1024, help="prompt length (default 1024)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--chunk-tokens", type=int, default=64, help="tokens per stored block (default 64)")
    parser.add_argument("--device", help="torch device (default: cuda when present, else cpu)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        import torch
    except ModuleNotFoundError as exc:   # torch is not a core dependency
        raise KVStoreError("kvstore demo needs torch and transformers: install torch first (your CUDA build, or "
                           "pip install torch --index-url https://download.pytorch.org/whl/cpu), then "
                           f"{install_hint('demo')}") from exc

    from kvstore import _ttft as T
    from kvstore.buffers.device import resolve_device
    from kvstore.config import load_config
    from kvstore.errors import InvalidArgumentError
    from kvstore.store import Store

    if args.tokens < 2 * args.chunk_tokens:
        raise InvalidArgumentError(f"--tokens must be at least 2 x --chunk-tokens ({2 * args.chunk_tokens})")
    T.require_transformers()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = load_config(args.config) if args.config else load_config(
        {"tiers": [{"name": "dram", "kind": "dram", "capacity": "1GiB"}]})
    steps = ["build model", "recompute prefill + generate", "save prompt KV", "load KV + generate"]
    with tqdm(total=len(steps), desc="demo", unit="step") as bar, Store(config) as store:
        bar.set_postfix_str(steps[0])
        model = T.build_model(args.model, device=device, max_positions=args.tokens + args.new_tokens + 64)
        T.warm_up(model, device)
        layout = T.KVLayout.of(model, args.chunk_tokens)
        ns = layout.namespace(f"kvstore-demo-{args.model}")
        prompt = T.make_prompt(args.tokens, model.config.vocab_size, seed=args.tokens, device=device)
        bar.update()
        bar.set_postfix_str(steps[1])
        ref, cache = T.run_recompute(model, prompt, layout, args.new_tokens)
        bar.update()
        bar.set_postfix_str(steps[2])
        saved = T.save_prompt(store, ns, prompt, cache, layout)
        del cache
        bar.update()
        bar.set_postfix_str(steps[3])
        got = T.run_load(model, store, ns, prompt, layout, args.new_tokens)
        bar.update()
    params = sum(p.numel() for p in model.parameters()) / 1e6
    same = got.tokens == ref.tokens
    print(f"model: {args.model} Llama, {params:.3g}M parameters, random weights, on {device}")
    print(f"prompt: {args.tokens} tokens; {saved} blocks of {layout.chunk_tokens} tokens "
          f"({layout.block_bytes} B each) saved to tiers {[t.name for t in config.tiers]}")
    print(f"{'':<22}{'TTFT s':>10}{f'{args.new_tokens} tokens s':>14}")
    print(f"{'recompute prefill':<22}{ref.ttft_s:>10.3f}{ref.total_s:>14.3f}")
    print(f"{'load KV from kvstore':<22}{got.ttft_s:>10.3f}{got.total_s:>14.3f}")
    print(f"speed-up of TTFT: {ref.ttft_s / got.ttft_s:.1f}x; "
          f"load {got.parts['load_s'] * 1e3:.1f} ms, last chunk compute {got.parts['last_chunk_s'] * 1e3:.1f} ms")
    print(f"generated tokens identical: {'yes' if same else 'NO'}  {ref.tokens[:8]}...")
    return 0 if same else 1
