#!/usr/bin/env bash
# Core Python dependencies. torch first, pinned: an unpinned torch pulls a CUDA build (the
# package itself no longer needs torch; the test extra does, for the GPU-path and connector
# tests).
set -euo pipefail
# The distribution used to be named "kvstore" (now "kvstore-cache"); an old editable
# install of it would keep a second finder for the same import name: remove it.
if python -m pip show kvstore >/dev/null 2>&1; then
    python -m pip uninstall -y -q kvstore
fi
python -m pip install -q --disable-pip-version-check "torch==2.13.0"
python -m pip install -q --disable-pip-version-check -e ".[test,events,replay,redis]"
