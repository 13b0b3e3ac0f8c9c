"""GPUDirect Storage through kvikio: reads and writes of *device* buffers at a file offset.

The NVMe tier calls this for CUDA tensors so blocks move between the drive and HBM
without a bounce through host memory (cuFile/GDS where the platform supports it;
kvikio's own POSIX compatibility mode otherwise, which still avoids our staging).
Host buffers never come here: without a CUDA driver kvikio cannot do I/O at all,
so the NVMe tier keeps its own POSIX / O_DIRECT path for them.

Nothing here imports kvikio at module import time; :func:`kvikio_available` answers
``(False, reason)`` with an actionable reason when kvikio, CUDA or the driver is absent.

Thread-safety: a :class:`KvikioFile` may be used from several threads at once (kvikio
handles are; offsets are explicit). Callers own the buffers and must keep them alive
until the call returns (every call here waits for its I/O).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from kvstore.errors import InvalidArgumentError, TierIOError, TierUnavailableError

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def kvikio_available() -> tuple[bool, str]:
    """``(True, description)`` when kvikio can move device buffers here, else
    ``(False, reason)``. Cached: the answer does not change within a process."""
    try:
        import kvikio
    except ImportError:
        return False, ("kvikio is not installed (pip install kvikio-cu12, or the slim set: "
                       "pip install --no-deps kvikio-cu12 libkvikio-cu12 rapids-logger "
                       "cuda-pathfinder nvidia-cufile-cu12)")
    except Exception as exc:  # a broken install (missing libcufile, ABI) must not crash callers
        return False, f"kvikio failed to import: {type(exc).__name__}: {exc}"
    try:
        import torch

        if not torch.cuda.is_available():
            return False, "kvikio is installed but there is no CUDA device (GPUDirect Storage needs a GPU)"
    except Exception as exc:
        return False, f"cannot query CUDA through torch: {exc}"
    return True, f"kvikio {getattr(kvikio, '__version__', '?')} ({gds_mode()})"


def gds_mode() -> str:
    """``"gds"`` when cuFile does the I/O, ``"compat"`` when kvikio falls back to POSIX.
    Under ``AUTO`` (kvikio's default) the answer is what kvikio infers it will do, not
    ``"gds"`` by default: ``"auto"`` where this kvikio cannot say."""
    try:
        import kvikio.defaults as d

        compat = d.get("compat_mode") if hasattr(d, "get") else d.compat_mode()
        text = str(getattr(compat, "name", compat)).upper()
        if text.endswith("AUTO"):
            preferred = getattr(d, "is_compat_mode_preferred", None)
            if preferred is None:
                return "auto"
            return "compat" if preferred() else "gds"
        return "compat" if compat is True or text.endswith(("ON", "TRUE", "1")) else "gds"
    except Exception:
        return "unknown"


IO_THREADS = 8   # kvikio's pool defaults to one thread: one block in flight at a time


def _use_io_threads() -> None:
    """Give kvikio's thread pool :data:`IO_THREADS` threads unless the user chose a
    number (``KVIKIO_NTHREADS``)."""
    if os.environ.get("KVIKIO_NTHREADS"):
        return
    try:
        import kvikio.defaults as d

        if hasattr(d, "set"):
            d.set("num_threads", IO_THREADS)
        elif hasattr(d, "num_threads_reset"):
            d.num_threads_reset(IO_THREADS)
    except Exception as exc:  # an older or newer kvikio: keep its default
        log.warning("kvikio: could not set %d I/O threads: %s", IO_THREADS, exc)


_threads_set = False


def _device_ptr_check(buf: Any) -> None:
    if not hasattr(buf, "__cuda_array_interface__"):
        where = getattr(buf, "device", "host memory")
        raise InvalidArgumentError(
            f"kvikio I/O takes CUDA buffers only, got {type(buf).__name__} on {where}; "
            "host buffers use the NVMe tier's POSIX path")


class KvikioFile:
    """One file opened for GPUDirect I/O of device buffers at explicit offsets.

    ``flags``: ``"r"``, ``"r+"`` (read/write an existing file) or ``"w"``. Raises
    :class:`TierUnavailableError` when kvikio cannot be used (see
    :func:`kvikio_available`), :class:`TierIOError` on I/O failure or short transfer.
    """

    def __init__(self, path: str | os.PathLike, flags: str = "r+") -> None:
        ok, reason = kvikio_available()
        if not ok:
            raise TierUnavailableError(reason)
        import kvikio

        global _threads_set
        if not _threads_set:
            _use_io_threads()
            _threads_set = True
        self.path = os.fspath(path)
        try:
            self._f = kvikio.CuFile(self.path, flags)
        except Exception as exc:
            raise TierIOError(f"kvikio cannot open {self.path!r} ({flags}): {exc}") from exc

    def read_into(self, dst: Any, offset: int) -> int:
        """Fill all of the device buffer ``dst`` from ``offset``; returns bytes read."""
        return self._io(self._f.pread, dst, offset, "read")

    def write_from(self, src: Any, offset: int) -> int:
        """Write all of the device buffer ``src`` at ``offset``; returns bytes written."""
        return self._io(self._f.pwrite, src, offset, "write")

    def _io(self, op: Any, buf: Any, offset: int, what: str) -> int:
        """All of ``buf`` through ``op`` (``pread``/``pwrite``) at ``offset``; a failure or
        a short transfer is a :class:`TierIOError`."""
        _device_ptr_check(buf)
        n = _nbytes(buf)
        try:
            got = op(buf, n, offset).get()
        except Exception as exc:
            raise TierIOError(f"kvikio {what} of {n} bytes at {offset} in {self.path!r} failed: {exc}") from exc
        if got != n:
            raise TierIOError(f"short kvikio {what} in {self.path!r}: {got} of {n} bytes at {offset}")
        return got

    def close(self) -> None:
        f, self._f = getattr(self, "_f", None), None
        if f is not None:
            f.close()

    def __enter__(self) -> "KvikioFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nbytes(buf: Any) -> int:
    if hasattr(buf, "element_size"):
        if not buf.is_contiguous():
            raise InvalidArgumentError("kvikio buffers must be contiguous")
        return buf.numel() * buf.element_size()
    return int(buf.nbytes)


__all__ = ["KvikioFile", "gds_mode", "kvikio_available"]
