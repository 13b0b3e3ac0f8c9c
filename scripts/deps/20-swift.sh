#!/usr/bin/env bash
# OpenStack Swift with its s3api middleware: the real S3-compatible server the S3 tier's
# tests and benchmark run against (MinIO and friends are not installable on these machines).
# Idempotent: returns at once when the servers are already installed.
set -euo pipefail
need=()
for bin in swift-proxy-server swift-account-server swift-container-server swift-object-server \
           swift-ring-builder memcached; do
    command -v "$bin" >/dev/null 2>&1 || need+=("$bin")
done
python -c "import boto3" 2>/dev/null || python -m pip install -q --disable-pip-version-check "boto3>=1.34"
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
pkgs=(swift swift-proxy swift-account swift-container swift-object memcached)
if ! $SUDO apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1; then
    $SUDO apt-get update -qq >/dev/null
    $SUDO apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
fi
