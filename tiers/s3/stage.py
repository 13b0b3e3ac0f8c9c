"""Host buffers of the S3 tier, kept per thread and reused across requests: a staging
buffer for device (CUDA) blocks, and upload buffers holding header + payload.

Thread-safe by construction: every buffer belongs to the thread that asked for it
(``threading.local``) and is only valid until that thread's next call.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvstore.block import EXT_HEADER_BYTES, encode_ext_header
from kvstore.buffers import copy_bytes, host_view, is_device
from kvstore.buffers.views import ThreadBuffer
from kvstore.keys import BlockKey


class Staging:
    """Per-thread buffers for blocks split into parts of ``part_size`` once header +
    payload reach ``multipart_threshold`` bytes."""

    def __init__(self, part_size: int, multipart_threshold: int) -> None:
        self._part_size = part_size
        self._multipart_threshold = multipart_threshold
        self._local = threading.local()   # this thread's upload buffers
        self._host = ThreadBuffer()

    def host(self, nbytes: int) -> np.ndarray:
        """This thread's reusable staging buffer, at least ``nbytes`` long."""
        return self._host.get(nbytes)

    def stage(self, key: BlockKey, src: Any, n: int, payload_checksum: int | None = None) -> list[bytearray]:
        """Version-2 header + payload copied once into this thread's upload buffers: one
        for a single PUT, one per part for a multipart upload. The header carries
        ``payload_checksum`` (the writer's XXH3-64) when given, else a hash of ``src``.

        ``bytearray`` because botocore sends one as it is, in one ``sendall``, and resends
        it unchanged when it retries; a ``bytes`` body it wraps in ``BytesIO``, which it
        then sends in 16 KiB pieces after an ``Expect: 100-continue`` round trip.
        """
        if is_device(src):
            host = self.host(n)
            copy_bytes(host, src)
        else:
            host = host_view(src)
        hb = EXT_HEADER_BYTES
        total = hb + n
        piece = self._part_size if total >= self._multipart_threshold else total
        pieces = self._upload_buffers(total, piece)
        encode_ext_header(key.digest, key.parent, host, memoryview(pieces[0])[:hb], payload_checksum=payload_checksum)
        for k, buf in enumerate(pieces):
            a = k * piece                      # this piece's offset in the object
            lo = max(a, hb)
            dst = np.frombuffer(buf, np.uint8)[lo - a:]
            np.copyto(dst, host[lo - hb:lo - hb + dst.nbytes], casting="no")
        return pieces

    def _upload_buffers(self, total: int, piece: int) -> list[bytearray]:
        """Pre-touched buffers covering ``total`` bytes in ``piece``-sized parts, kept per
        thread and per shape (blocks of one model share a size, so they are reused)."""
        cache = getattr(self._local, "uploads", None)
        if cache is None:
            cache = self._local.uploads = {}
        bufs = cache.get((total, piece))
        if bufs is None:
            if len(cache) >= 4:
                cache.pop(next(iter(cache)))
            bufs = [bytearray(min(piece, total - a)) for a in range(0, total, piece)]
            cache[(total, piece)] = bufs
        return bufs
