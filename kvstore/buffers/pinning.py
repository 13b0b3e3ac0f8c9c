"""Registering a host memory range with CUDA (page-locking it for fast, asynchronous
copies), done right: lazily, on the first device copy, so a process that never copies to
a device (the cache server, vLLM's scheduler) never creates a CUDA context; exactly once;
unregistered exactly once when the memory goes away, so a later mapping at the same
address is never copied through a stale registration; a failure clears CUDA's sticky
"last error" (it would surface later in an unrelated kernel launch) and logs its code;
and a private mapping is marked ``MADV_DONTFORK`` first, so a forked child's
copy-on-write never splits the pages the driver pinned from the ones this process reads.

Thread-safe.
"""

from __future__ import annotations

import logging
import mmap
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)
CUDA_HOST_REGISTER_READ_ONLY = 0x08   # cudaHostRegisterReadOnly: a mapping this process may only read


def _torch_cudart() -> Any | None:
    """CUDA's runtime API through torch, or None where there is no usable GPU."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.cudart() if torch.cuda.is_available() else None


def _code(ret: Any) -> int:
    return int(ret[0] if isinstance(ret, tuple) else ret)


class HostPin:
    """The CUDA registration of ``nbytes`` at ``ptr`` (inside ``mm``, a mapping this
    object does not own). ``shared``: a shared mapping (no fork mark needed);
    ``read_only``: this process may only read it (registered with
    ``cudaHostRegisterReadOnly``). ``cudart`` finds the runtime (torch's by default;
    tests give a stand-in)."""

    def __init__(self, mm: mmap.mmap, ptr: int, nbytes: int, *, name: str, shared: bool, read_only: bool = False,
                 cudart: Callable[[], Any | None] = _torch_cudart) -> None:
        self._mm, self._ptr, self._nbytes = mm, ptr, nbytes
        self._name, self._shared, self._cudart = name, shared, cudart
        self._flags = CUDA_HOST_REGISTER_READ_ONLY if read_only else 0
        self._lock = threading.Lock()
        self._state = "new"          # new -> pinned | failed -> released
        self._rt: Any = None

    @property
    def pinned(self) -> bool:
        return self._state == "pinned"

    def ensure(self) -> bool:
        """Register the range now unless that was done or tried before; whether it is
        registered. Call before a device copy."""
        if self._state != "new":
            return self._state == "pinned"
        with self._lock:
            if self._state != "new":
                return self._state == "pinned"
            self._state = self._register()
            return self._state == "pinned"

    def _register(self) -> str:
        rt = self._cudart()
        if rt is None:
            return "failed"
        if not self._shared:
            try:
                self._mm.madvise(mmap.MADV_DONTFORK)
            except (AttributeError, OSError) as exc:
                log.warning("%s: MADV_DONTFORK refused (%s): not pinning a private arena that a "
                            "fork could split", self._name, exc)
                return "failed"
        try:
            code = _code(rt.cudaHostRegister(self._ptr, self._nbytes, self._flags))
        except Exception as exc:  # pinning is an optimisation; pageable memory still works
            log.warning("%s: cudaHostRegister raised %s; copies use pageable memory", self._name, exc)
            code = -1
        if code != 0:
            last = _code(rt.cudaGetLastError())   # clears the sticky error this left behind
            log.warning("%s: cudaHostRegister of %d bytes failed (error %d, last error %d); "
                        "copies use pageable memory", self._name, self._nbytes, code, last)
            return "failed"
        self._rt = rt
        return "pinned"

    def release(self) -> None:
        """Unregister (once) before the mapping is unmapped; no-op when never pinned."""
        with self._lock:
            state, self._state = self._state, "released"
            if state != "pinned":
                return
            code = _code(self._rt.cudaHostUnregister(self._ptr))
            if code != 0:
                last = _code(self._rt.cudaGetLastError())
                log.warning("%s: cudaHostUnregister failed (error %d, last error %d)",
                            self._name, code, last)


__all__ = ["HostPin"]
