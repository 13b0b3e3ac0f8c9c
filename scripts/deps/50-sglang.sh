#!/usr/bin/env bash
# SGLang 0.5.23 for the connector tests (shared/ENGINES.md 4.3, light recipe plus the
# host-pool extras). sglang's own metadata pins a CUDA torch 2.14.1, so it goes in with
# --no-deps and its runtime imports are installed by hand. torch is never touched here.
# transformers is left alone when an installed version already fits both sglang and
# vllm 0.33 (>=5.16.1,<5.21.0). Fast no-op once everything imports.
set -euo pipefail
PIP=(python -m pip install -q --disable-pip-version-check)

if python - <<'PY' 2>/dev/null
import importlib.metadata as md, importlib.util as iu
assert md.version("sglang") == "0.5.23"
mods = ("orjson psutil pybase64 requests triton PIL starlette msgspec zmq tqdm IPython aiohttp "
        "transformers sentencepiece gguf tvm_ffi loguru dill compressed_tensors").split()
assert all(iu.find_spec(m) for m in mods)
PY
then
    exit 0
fi

"${PIP[@]}" --no-deps "sglang==0.5.23"
"${PIP[@]}" numpy packaging orjson psutil pybase64 requests triton pillow starlette msgspec \
    pydantic pyzmq tqdm IPython aiohttp sentencepiece gguf "apache-tvm-ffi==0.1.11" loguru dill
python - <<'PY' || "${PIP[@]}" "transformers>=5.16.1,<5.21.0"
import importlib.metadata as md
from packaging.version import Version
v = Version(md.version("transformers"))
assert Version("5.16.1") <= v < Version("5.21.0")
PY
# Unpinned, compressed-tensors would "upgrade" torch to a CUDA build.
"${PIP[@]}" --no-deps "compressed-tensors==0.18.0"
