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
WHEEL="mooncake-transfer-engine-non-cuda==0.3.13.post1"
installed() {
    python -c "import mooncake.store" 2>/dev/null && command -v mooncake_master >/dev/null 2>&1 \
        && command -v mooncake_client >/dev/null 2>&1
}
installed && exit 0
# A wheel that does not install here (no build for this platform or Python) must not stop
# the rest of the suite: say so, loudly. Under CI every test of tests/test_tier_mooncake.py
# then fails with the reason; elsewhere they are skipped with it. Never a silent skip.
if ! python -m pip install -q --disable-pip-version-check "$WHEEL" || ! installed; then
    echo "65-mooncake.sh: $WHEEL did not install (see pip's output above);" \
         "the mooncake tier's tests fail under CI and are skipped elsewhere" >&2
fi
