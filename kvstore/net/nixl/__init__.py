"""NIXL, shared by both ends: whether it is usable here (:func:`nixl_available`; importing
this package never loads NIXL), the agent wrapper (:mod:`kvstore.net.nixl.endpoint`),
descriptor lists (:mod:`~kvstore.net.nixl.descs`), UCX's environment
(:mod:`~kvstore.net.nixl.env`) and ``kvstore doctor``'s plugin probe
(:mod:`~kvstore.net.nixl.probe`). Each end's use of it has one module:
:mod:`kvstore.net.client.nixl` and :mod:`kvstore.net.server._nixl`.
"""

from __future__ import annotations

import importlib.util
import threading

_nixl_state: tuple[bool, str] | None = None
_nixl_lock = threading.Lock()


def nixl_available() -> tuple[bool, str]:
    """``(True, version)`` when the ``nixl`` package imports, else ``(False, reason)``.
    Cached for the process; does not create an agent (a failure there is a runtime
    fallback, counted by :class:`kvstore.net.client.selection.FallbackCounter`)."""
    global _nixl_state
    with _nixl_lock:
        if _nixl_state is None:
            _nixl_state = _probe_nixl_import()
        return _nixl_state


def _probe_nixl_import() -> tuple[bool, str]:
    if importlib.util.find_spec("nixl") is None:
        return False, "the nixl package is not installed (pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1)"
    from kvstore.net.nixl.env import prepare_ucx_env

    prepare_ucx_env()
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as exc:  # a broken wheel or missing native library: NIXL is unusable
        return False, f"nixl does not import: {type(exc).__name__}: {exc}"
    from importlib.metadata import PackageNotFoundError, version

    try:
        return True, version("nixl")
    except PackageNotFoundError:
        return True, "unknown version"


__all__ = ["nixl_available"]
