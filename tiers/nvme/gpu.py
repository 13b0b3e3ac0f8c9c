"""CUDA buffers on the NVMe tier: kvikio ``CuFile`` (GPUDirect Storage, or kvikio's
POSIX compat mode) for reads into device memory, host staging otherwise.

Writes from device memory copy to a host staging buffer once (the checksum is computed
there) and then go out with the host path's ``O_DIRECT`` write. Reads land in device
memory by DMA and are verified before the read reports success: a block written with
the segmented checksum (``FLAG_SEGMENTED``, the tier's ``device_verify``) is hashed where
it landed, by a CUDA kernel (:mod:`kvstore._segsum_cuda`), and only its segment digests
come back to the host; any other block is copied to a host buffer and hashed there.
The kernel is checked against the host implementation once per process before its
first use; where cupy is missing or that check fails, verification stays on the host
(logged). Without CUDA or kvikio, device reads bounce through host memory. kvikio is
reached only through :mod:`tiers.nvme.kvikio` and only once a device buffer appears, so
host-only machines never depend on it (it cannot do host I/O without a CUDA driver).
Thread-safe.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from kvstore.buffers.streams import wait_for_caller
from kvstore.block import FLAG_SEGMENTED, HEADER_BYTES, verify_payload
from kvstore.buffers import copy_bytes, device_view
from kvstore.errors import CorruptBlockError, TierIOError
from kvstore.tiers.nvme.kvikio import KvikioFile, kvikio_available
from kvstore.tiers.nvme.io import PAGE, _Scratch, check_header, read_block

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


def verify_where(flags: int, dst) -> str:
    """Where a payload read into ``dst`` is verified: ``"device"`` when its block carries
    the segmented checksum and ``dst`` is a CUDA tensor, else ``"host"``."""
    return "device" if flags & FLAG_SEGMENTED and getattr(dst, "is_cuda", False) else "host"


_kernel_ok: bool | None = None
_kernel_lock = threading.Lock()


def device_kernel_ok() -> bool:
    """Whether the device checksum may be trusted here: cupy imports and its kernel
    agrees with the host implementation on a test payload (checked once per process;
    a kernel that disagreed would turn every good block into a removed "corrupt" one)."""
    global _kernel_ok
    with _kernel_lock:
        if _kernel_ok is None:
            try:
                from kvstore._segsum_cuda import check_device_checksum

                result = check_device_checksum(sizes=(3 * (64 << 10) + 5,), repeats=1)
                _kernel_ok = bool(result["ok"])
                if not _kernel_ok:
                    log.error("NVMe tier: device checksum disagrees with the host or cannot run (%s); "
                              "verifying device reads on the host", result["error"] or result["rows"])
            except Exception as exc:   # cupy missing or broken: the host path still verifies
                log.warning("NVMe tier: no device checksum (%s: %s); verifying device reads on the host",
                            type(exc).__name__, exc)
                _kernel_ok = False
        return _kernel_ok


class DeviceIO:
    """Reads and writes for device (CUDA) buffers; ``mode`` as from :func:`detect_mode`,
    settled when the first device buffer arrives."""

    def __init__(self) -> None:
        self._mode: str | None = None
        self._files: dict[str, KvikioFile] = {}
        self._lock = threading.Lock()
        self._staging = _Scratch()   # per thread
        self.verified_on_device = 0   # reads whose payload was hashed where it landed

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
        head = check_header(header[:HEADER_BYTES], digest, length, csum)
        if verify_where(head.flags, dst) == "device" and device_kernel_ok():
            from kvstore._segsum_cuda import device_checksum

            try:
                on_device = device_checksum(dst)
            except Exception as exc:   # e.g. out of device memory: verify this one on the host
                log.warning("NVMe tier: device checksum failed (%s: %s); verifying on the host", type(exc).__name__, exc)
            else:
                if on_device != csum:
                    raise CorruptBlockError("block payload checksum mismatch (verified on the device)")
                with self._lock:
                    self.verified_on_device += 1
                return
        host = self._staging.bounce_of(length)
        copy_bytes(host, dst)
        verify_payload(host, length, csum, head.flags)

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
