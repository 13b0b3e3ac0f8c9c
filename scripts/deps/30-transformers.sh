#!/usr/bin/env bash
# Hugging Face transformers for the end-to-end TTFT proof (tests/test_ttft.py, `kvstore demo`).
# Pinned to the range vLLM 0.33 / SGLang 0.5.23 accept; never lets pip touch torch.
set -euo pipefail
if python -c "import transformers, sys; v = tuple(int(x) for x in transformers.__version__.split('.')[:2]); sys.exit(0 if (5, 16) <= v < (5, 21) else 1)" 2>/dev/null; then
    exit 0
fi
python -m pip install -q --disable-pip-version-check --no-deps "transformers==5.19.0"
python -m pip install -q --disable-pip-version-check "tokenizers>=0.23.2,<0.24" "safetensors>=0.4" \
    "huggingface_hub>=1.31,<3" "regex" "packaging" "typer" "filelock" "tqdm" "pyyaml" "numpy"
