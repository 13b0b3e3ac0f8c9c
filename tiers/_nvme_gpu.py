"""CUDA buffers on the NVMe tier: kvikio ``CuFile`` (GPUDirect Storage, or kvikio's
POSIX compat mode) for reads into device memory, host staging otherwise.

Every block is verified by its XXH3 checksum, which is computed on the host, so writes
from device memory copy to a host staging buffer once (needed for the checksum) and
then go out with the host path's ``O_DIRECT`` write; reads land in device memory by
DMA and a host copy is hashed before the read reports success. Without CUDA or kvikio,
device reads bounce through host memory. kvikio is reached only through
:mod:`tiers._kvikio` and only once a device buffer appears, so host-only machines never
depend on it (it cannot do
host I/O without a CUDA driver). Thread-safe.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from kvstore._streams import wait_for_caller
from kvstore.block import HEADER_BYTES, parse_header, verify_payload
from kvstore.buffers import copy_bytes, device_view
from kvstore.errors import CorruptBlockError, TierIOError
from tiers._kvikio import KvikioFile, kvikio_available
from tiers._nvme_io import PAGE, _Scratch, read_block

log = logging.getLogger(__name__)


def detect_mode() -> str:
    """``"kvikio"`` when CUDA and kvikio are usable, ``"bounce"`` when only CUDA is,
    ``"none"`` on host-only machines (no device buffers can arrive)."""
    if "torch" not in sys.modules:
        return "none"   # nobody can hold a CUDA tensor yet; importing torch costs seconds
    import torch

    if not torch.cuda.is_available():
        return "none"
    ok, reason = kvikio_available()
    if not ok:
        log.info("NVMe tier: %s; device buffers bounce through host memory", reason)
        return "bounce"
    return "kvikio"


class DeviceIO:
    """Reads and writes for device (CUDA) buffers; ``mode`` as from :func:`detect_mode`,
    settled when the first device buffer arrives."""

    def __init__(self) -> None:
        self._mode: str | None = None
        self._files: dict[str, KvikioFile] = {}
        self._lock = threading.Lock()
        self._staging = _Scratch()   # per thread

    @property
    def mode(self) -> str:
        if self._mode is None:
            mode = detect_mode()
            if mode == "none":
                return mode
            self._mode = mode
        return self._mode

    def stage(self, src) -> "np.ndarray":
        """Copy a device buffer into this thread's aligned host staging buffer (reused)."""
        n = src.numel() * src.element_size()
        host = self._staging.bounce_of(n)
        copy_bytes(host, src)
        return host

    def read(self, fd: int, path: str, offset: int, digest: bytes, length: int, csum: int, dst) -> None:
        """Read and verify one block into device buffer ``dst``; raises
        :class:`CorruptBlockError` / :class:`TierIOError` like the host path."""
        if self.mode != "kvikio":
            host = self._staging.bounce_of(length)
            read_block(fd, offset, digest, length, csum, host)
            copy_bytes(dst, host)
            return
        header = self._staging.header
        wait_for_caller()     # kvikio writes dst outside stream order: after the caller's kernels
        try:
            got = os.preadv(fd, [header], offset)
        except OSError as exc:
            raise TierIOError(f"read of the header at offset {offset} failed: {exc.strerror}") from exc
        if got != PAGE:
            raise CorruptBlockError(f"short read at offset {offset} (file truncated?)")
        try:
            self._file(path).read_into(device_view(dst), offset + PAGE)
        except TierIOError as exc:
            if "short" in str(exc):
                raise CorruptBlockError(str(exc)) from exc
            raise
        hlen, hsum = parse_header(header[:HEADER_BYTES], digest=digest)
        if hlen != length or hsum != csum:
            raise CorruptBlockError("block header disagrees with the index")
        host = self._staging.bounce_of(length)
        copy_bytes(host, dst)
        verify_payload(host, length, csum)

    def _file(self, path: str) -> KvikioFile:
        with self._lock:
            handle = self._files.get(path)
            if handle is None:
                handle = self._files[path] = KvikioFile(path, "r")
            return handle

    def close(self) -> None:
        with self._lock:
            for handle in self._files.values():
                try:
                    handle.close()
                except Exception:  # kvikio may raise anything at close; best effort at shutdown
                    pass
            self._files.clear()
