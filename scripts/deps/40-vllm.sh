#!/usr/bin/env bash
# vLLM 0.33.0 for the connector tests, on the CPU torch (ENGINES.md 4.2).
# vllm pins torch==2.14.0 (CUDA): install it with --no-deps, then only the runtime
# modules its scheduler/connector path imports. torch is never touched here.
# transformers is a range that sglang 0.5.23's pin (5.19.0) also satisfies.
set -euo pipefail
PIP=(python -m pip install -q --disable-pip-version-check)
if python - <<'PY' 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("vllm") == "0.33.0" and m.version("xgrammar") == "0.2.8" else 1)
PY
then
    exit 0
fi
"${PIP[@]}" --no-deps "vllm==0.33.0"
"${PIP[@]}" packaging numpy regex cachetools psutil "transformers>=5.16.1,<5.21.0" \
    "huggingface_hub>=1.31.0" "tokenizers>=0.23.2" safetensors pydantic msgspec pyzmq cloudpickle \
    blake3 cbor2 pybase64 prometheus_client requests tqdm pyyaml einops sentencepiece py-cpuinfo \
    setproctitle aiohttp openai openai-harmony pillow uvloop fastapi partial-json-parser llguidance \
    "apache-tvm-ffi==0.1.11" "torch==2.13.0"
"${PIP[@]}" --no-deps "xgrammar==0.2.8"
