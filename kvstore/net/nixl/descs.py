"""Descriptor lists for NIXL transfers and the staging buffers they point into (see
:mod:`kvstore.net.nixl.endpoint`)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvstore.buffers import host_view, is_device, is_torch, nbytes_of
from kvstore.errors import InvalidArgumentError, ProtocolError

_PAGE = 4096
_MEM_CODES = {"DRAM": 0, "VRAM": 1}
_MEM_NAMES = {v: k for k, v in _MEM_CODES.items()}
_DESC_HEADER = struct.Struct("<BxxxI")  # memory kind, row count; rows follow as 3 x u64


@dataclass(frozen=True)
class Descs:
    """Transfer descriptors: rows of ``(address, nbytes, device_id)`` in one memory kind
    (``"DRAM"`` or ``"VRAM"``). Immutable; addresses belong to whoever built it."""

    mem: str
    rows: np.ndarray  # (N, 3) uint64

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def sizes(self) -> list[int]:
        return [int(n) for n in self.rows[:, 1]]

    def subset(self, indices: Sequence[int]) -> "Descs":
        return Descs(self.mem, self.rows[np.asarray(indices, dtype=np.int64)])

    def to_bytes(self) -> bytes:
        return _DESC_HEADER.pack(_MEM_CODES[self.mem], len(self.rows)) + self.rows.astype("<u8").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, *, max_rows: int = 1 << 20) -> "Descs":
        """Parse the wire form; raises :class:`ProtocolError` when it is malformed."""
        if len(data) < _DESC_HEADER.size:
            raise ProtocolError(f"descriptor list truncated: {len(data)} bytes")
        code, count = _DESC_HEADER.unpack_from(data)
        if code not in _MEM_NAMES:
            raise ProtocolError(f"descriptor list has unknown memory kind {code}")
        if count > max_rows:
            raise ProtocolError(f"descriptor list has {count} rows, at most {max_rows} allowed")
        if len(data) != _DESC_HEADER.size + 24 * count:
            raise ProtocolError(f"descriptor list of {count} rows needs {_DESC_HEADER.size + 24 * count} "
                                f"bytes, got {len(data)}")
        rows = np.frombuffer(data, dtype="<u8", offset=_DESC_HEADER.size, count=3 * count).reshape(count, 3)
        return cls(_MEM_NAMES[code], rows.astype(np.uint64))


def descs_of(bufs: Sequence[Any]) -> Descs:
    """Descriptors for caller buffers (bytes-like, numpy, torch CPU or CUDA tensors), all
    in one memory kind. The buffers must stay alive and unmoved while they are used."""
    if not bufs:
        raise InvalidArgumentError("no buffers given")
    rows = np.empty((len(bufs), 3), dtype=np.uint64)
    kinds = set()
    for i, buf in enumerate(bufs):
        if type(buf) is np.ndarray and buf.flags.c_contiguous:  # the common case, without host_view's checks
            rows[i] = (buf.ctypes.data, buf.nbytes, 0)
            kinds.add("DRAM")
        elif is_torch(buf):
            if not buf.is_contiguous():
                raise InvalidArgumentError("tensor buffers must be contiguous")
            rows[i] = (buf.data_ptr(), nbytes_of(buf), max(buf.get_device(), 0))
            kinds.add("VRAM" if is_device(buf) else "DRAM")
        else:
            arr = host_view(buf)
            rows[i] = (arr.ctypes.data, arr.nbytes, 0)
            kinds.add("DRAM")
    if len(kinds) != 1:
        raise InvalidArgumentError("one transfer takes buffers of one memory kind (all host or all GPU)")
    return Descs(kinds.pop(), rows)


def staging_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned, pre-touched host buffer of ``nbytes`` for NIXL staging (the caller
    owns it). Page alignment keeps it at the arena's offset modulo 64 bytes: a copy between
    buffers that sit apart modulo a cache line (numpy's own arrays start 16 bytes in) runs
    markedly slower, the kernel's cross-memory copy as much as memcpy."""
    raw = np.empty(nbytes + _PAGE, np.uint8)
    start = (-raw.ctypes.data) % _PAGE
    buf = raw[start:start + nbytes]
    buf.fill(0)  # fault the pages in now, not inside a transfer
    return buf
