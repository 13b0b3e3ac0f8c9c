#!/usr/bin/env bash
# NIXL (NVIDIA's transfer library, UCX backend) for the nixl transport, and Debian's
# pyverbs for `kvstore doctor`. --no-deps: the nixl wheels would otherwise pull a CUDA
# torch; nixl 1.5.2's meta package pins wheels that are not published, so 1.5.1.
set -euo pipefail
if ! python -c "import nixl._api" >/dev/null 2>&1; then
    python -m pip install -q --disable-pip-version-check --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1"
fi
if [ ! -e /usr/lib/python3/dist-packages/pyverbs ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pyverbs; } >/dev/null 2>&1 \
        || echo "60-nixl.sh: python3-pyverbs not installed (kvstore doctor falls back to sysfs)" >&2
fi
