#!/usr/bin/env bash
# Redis (Debian's redis-server + redis-cli): the real servers the redis tier's tests and
# benchmark start on loopback, standalone and as a 3-master Cluster. None auto-starts here
# (the package's service is not enabled without systemd). Idempotent: returns at once when
# installed. The Python client (redis-py + hiredis) comes with 00-python.sh.
set -euo pipefail
command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
pkgs=(redis-server redis-tools)
if ! $SUDO apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1; then
    $SUDO apt-get update -qq >/dev/null
    $SUDO apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
fi
