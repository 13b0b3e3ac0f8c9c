#!/usr/bin/env bash
# Install the systems benchmarks/server.py compares against. Not needed by the tests.
#   Mooncake Store (mooncake-transfer-engine-non-cuda), LMCache 0.5.6's server, redis-server.
# Python peers go into their own virtualenv (.venv/peers, system site packages visible)
# because LMCache pins numpy and prometheus_client below what kvstore uses.
# Usage: bash benchmarks/install_peers.sh      (idempotent; skips what is installed)
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=.venv/peers
export DEBIAN_FRONTEND=noninteractive
need_apt=()
for pkg in redis-server libibverbs1 libnuma1; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
    apt-get update -qq && apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
[ -x "$VENV/bin/python" ] || python -m venv --system-site-packages "$VENV"
PIP="$VENV/bin/python -m pip install -q --disable-pip-version-check"
"$VENV/bin/python" -c "import mooncake.store" 2>/dev/null || $PIP mooncake-transfer-engine-non-cuda
"$VENV/bin/python" -c "import redis, hiredis" 2>/dev/null || $PIP "redis[hiredis]"
if ! "$VENV/bin/python" -c "import lmcache" 2>/dev/null; then
    # LMCache's own requirements, less the CUDA-only ones (cupy-cuda13x, cuda-python,
    # cufile-python) and torch (the system's CPU build is used; never upgrade it).
    $PIP --no-deps lmcache==0.5.6
    $PIP aiofile aiofiles blake3 aiohttp awscrt cryptography fastapi httpx "huggingface_hub>=1.5.0" \
        msgspec "numpy<=2.2.6" numba nvtx "opentelemetry-api>=1.20.0,<=1.40.0" "opentelemetry-sdk>=1.20.0" \
        "opentelemetry-exporter-otlp>=1.20.0" "opentelemetry-exporter-prometheus>=0.50b0,<=0.61b0" \
        "prometheus_client>=0.18.0,<=0.24.1" psutil py-cpuinfo pyyaml "pyzmq>=25.0.0" "grpcio>=1.78.0" \
        "protobuf>=6.31.1,<7" redis safetensors sortedcontainers uvicorn httptools cachetools \
        "setuptools>=77.0.3,<81" "setuptools_scm>=8" "transformers>=5.4" \
        "torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])')"
fi
# kvstore's own runtime dependencies, read from pyproject.toml: the benchmarks run kvstore
# under this Python too (nvme_paired.py --lmcache-python, server.py's peers), from a clean
# clone. torch stays the system's; LMCache's pins (numpy, prometheus_client) hold.
if ! "$VENV/bin/python" -c "import kvstore.store, kvstore.tiers.nvme" 2>/dev/null; then
    mapfile -t KV_DEPS < <("$VENV/bin/python" - <<'PY'
import re
import tomllib

with open("pyproject.toml", "rb") as f:
    for dep in tomllib.load(f)["project"]["dependencies"]:
        if re.split(r"[\s<>=!~;\[]", dep, maxsplit=1)[0].lower() != "torch":
            print(dep)
PY
)
    printf '%s\n' "numpy<=2.2.6" "prometheus_client<=0.24.1" > "$VENV/kvstore-constraints.txt"
    $PIP -c "$VENV/kvstore-constraints.txt" "${KV_DEPS[@]}"
fi
"$VENV/bin/python" - <<'PY'
for mod in ("mooncake.store", "redis", "hiredis", "lmcache", "kvstore.store", "kvstore.tiers.nvme"):
    try:
        __import__(mod)
        print(f"ok       {mod}")
    except Exception as exc:
        print(f"MISSING  {mod}: {exc}")
PY
command -v redis-server >/dev/null && echo "ok       redis-server" || echo "MISSING  redis-server"
