#!/usr/bin/env bash
# Core Python dependencies. torch first, pinned: an unpinned torch pulls a CUDA build.
set -euo pipefail
python -m pip install -q --disable-pip-version-check "torch==2.13.0"
python -m pip install -q --disable-pip-version-check -e ".[test,events,replay,redis]"
