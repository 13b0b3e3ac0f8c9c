#!/usr/bin/env bash
# Mooncake Store (the mooncake tier's pool): master and storage-node binaries plus the Python
# client, from the non-CUDA wheel (the CUDA wheels need libcuda). Its binaries need Debian's
# libibverbs1 and libnuma1. Idempotent: returns at once when installed.
set -euo pipefail
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
need=()
for pkg in libibverbs1 libnuma1; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    if ! $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1; then
        $SUDO apt-get update -qq >/dev/null
        $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    fi
fi
python -c "import mooncake.store" 2>/dev/null && command -v mooncake_master >/dev/null 2>&1 && exit 0
python -m pip install -q --disable-pip-version-check "mooncake-transfer-engine-non-cuda==0.3.13.post1"
