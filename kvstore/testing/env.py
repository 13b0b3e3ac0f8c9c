"""The test environment: a free local port, and whether this runs in CI."""

from __future__ import annotations

import os


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


IN_CI = bool(os.environ.get("CI"))
