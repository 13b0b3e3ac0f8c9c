#!/usr/bin/env bash
# Install everything the test suite needs, then run the whole suite.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
for step in scripts/deps/*.sh; do
    echo "== $step"
    bash "$step"
done
exec python -m pytest "$@"
