"""Process environment NIXL's bundled UCX needs, applied before UCX is loaded."""

from __future__ import annotations

import os
from pathlib import Path

SYSFS_INFINIBAND = Path("/sys/class/infiniband")


def has_infiniband() -> bool:
    """True when the kernel exposes at least one RDMA device."""
    try:
        return any(SYSFS_INFINIBAND.iterdir())
    except OSError:
        return False


def prepare_ucx_env() -> None:
    """Set ``UCX_MODULES=^ib`` when the node has no RDMA device and the user has not
    chosen UCX modules: NIXL's bundled UCX otherwise crashes at process exit (in libnl)
    after its work succeeded. Also quiets NIXL's INFO logging unless ``NIXL_LOG_LEVEL`` is
    set. Child processes inherit both."""
    if "UCX_MODULES" not in os.environ and not has_infiniband():
        os.environ["UCX_MODULES"] = "^ib"
    # NIXL logs every agent and backend creation at INFO to stdout, which would mix
    # into our own output (e.g. `kvstore doctor --json`); keep warnings and errors.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
