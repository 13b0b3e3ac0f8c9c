"""Block I/O on one data file: a header page then the payload, by ``pwritev``/``preadv``.

An extent on disk is ``PAGE`` bytes of header page (the 64-byte block header from
:mod:`kvstore.block`, zero padded) followed by the payload rounded up to ``PAGE``. The
header gets its own page so an aligned caller buffer is written and read in place with
``O_DIRECT`` (one vectored call, no bounce copy); only an unaligned caller buffer or a
payload whose length is not a page multiple touches the per-thread scratch pages.

Scratch buffers are per thread (``threading.local``), allocated once and reused; the
functions here are thread-safe as long as callers give each thread its own fd use
pattern (``pread``/``pwrite`` carry their own offsets, so sharing an fd is fine).
"""

from __future__ import annotations

import errno
import os
import threading

import numpy as np

from kvstore.block import HEADER_BYTES, VERSION, BlockHeader, checksum, encode_header, parse_block_header, parse_header
from kvstore.errors import CorruptBlockError, TierIOError

PAGE = 4096


def extent_bytes(nbytes: int) -> int:
    """On-disk size of a block with ``nbytes`` of payload: header page + rounded payload."""
    return PAGE + -(-nbytes // PAGE) * PAGE


def aligned_empty(nbytes: int, align: int = PAGE) -> np.ndarray:
    """A ``uint8`` array whose first byte sits on an ``align`` boundary (zeroed pages)."""
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


def is_aligned(arr: np.ndarray) -> bool:
    return arr.ctypes.data % PAGE == 0


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.out_pages = aligned_empty(0).reshape(0, PAGE)   # header pages for runs (writes)
        self.in_pages = aligned_empty(0).reshape(0, PAGE)    # header pages for runs (reads)
        self.header = aligned_empty(PAGE)        # reads land here: any bytes after the header
        self.head = memoryview(self.header)[:HEADER_BYTES]
        self.out = aligned_empty(PAGE)           # writes: only the first 64 bytes ever change,
        self.out_head = memoryview(self.out)[:HEADER_BYTES]   # so the padding stays zero
        self.tail = aligned_empty(PAGE)
        self.bounce = aligned_empty(0)

    def pages_of(self, name: str, count: int) -> np.ndarray:
        pages = getattr(self, name)
        if len(pages) < count:
            pages = aligned_empty(max(count, 16) * PAGE).reshape(-1, PAGE)
            setattr(self, name, pages)
        return pages

    def bounce_of(self, nbytes: int) -> np.ndarray:
        if self.bounce.nbytes < nbytes:
            self.bounce = aligned_empty(max(nbytes, 1 << 20))
        return self.bounce[:nbytes]


_scratch = _Scratch()


def io_error(message: str, exc: OSError) -> TierIOError:
    """A :class:`TierIOError` that keeps the OS error number (ENOSPC vs EIO matters)."""
    err = TierIOError(f"{message}: {exc.strerror or exc}")
    err.errno = exc.errno
    return err


def write_block(fd: int, offset: int, digest: bytes, payload: np.ndarray, flags: int = 0,
                payload_checksum: int | None = None) -> int:
    """Write header page + payload at ``offset``; returns the payload's checksum (the
    kind ``flags`` selects, see :mod:`kvstore.block`): ``payload_checksum`` when given
    (its writer's, of that kind), else hashed here.

    ``payload`` is a flat ``uint8`` host view owned by the caller, read only during the
    call. Raises :class:`TierIOError` (``errno`` kept) on a failed or short write.
    """
    s = _scratch
    n = payload.nbytes
    full = n - n % PAGE
    header = s.out
    if payload_checksum is None:
        payload_checksum = checksum(payload, flags)
    csum = encode_header(digest, payload, s.out_head, payload_checksum=payload_checksum, flags=flags)
    if is_aligned(payload):
        iov = [header, payload if full == n else payload[:full]] if full else [header]
        if n > full:
            tail = s.tail
            tail[:n - full] = payload[full:]
            tail[n - full:] = 0
            iov.append(tail)
    else:
        bounce = s.bounce_of(extent_bytes(n) - PAGE)
        bounce[:n] = payload
        bounce[n:] = 0
        iov = [header, bounce]
    _write_all(fd, iov, offset, extent_bytes(n))
    return csum


def _write_all(fd: int, iov: list, offset: int, total: int) -> None:
    """One ``pwritev`` of ``total`` bytes at ``offset``; :class:`TierIOError` when the
    medium fails it or takes less."""
    try:
        done = os.pwritev(fd, iov, offset)
    except OSError as exc:
        raise io_error(f"write of {total} bytes at offset {offset} failed", exc) from exc
    if done != total:
        raise TierIOError(f"short write: {done} of {total} bytes at offset {offset}")


def read_block(fd: int, offset: int, digest: bytes, length: int, csum: int, dst: np.ndarray) -> None:
    """Read the block at ``offset`` into ``dst`` (a writable flat ``uint8`` host view of
    ``length`` bytes, owned by the caller) and verify it before returning.

    The header must name ``digest`` and agree with the indexed ``length``/``csum``; the
    payload is hashed where it landed (``dst``), by the checksum its header's flags name. Raises :class:`CorruptBlockError` on
    any mismatch or short read (``dst`` then holds unspecified bytes) and
    :class:`TierIOError` when the medium fails.
    """
    if dst.nbytes != length:
        raise CorruptBlockError(f"payload length {dst.nbytes} differs from header's {length}")
    s = _scratch
    full = length - length % PAGE
    header = s.header
    if is_aligned(dst):
        iov = [header, dst if full == length else dst[:full]] if full else [header]
        if length > full:
            iov.append(s.tail)
        target = None
    else:
        target = s.bounce_of(extent_bytes(length) - PAGE)
        iov = [header, target]
    total = extent_bytes(length)
    try:
        got = os.preadv(fd, iov, offset)
    except OSError as exc:
        raise io_error(f"read of {length} bytes at offset {offset} failed", exc) from exc
    if got != total:
        raise CorruptBlockError(f"short read: {got} of {total} bytes at offset {offset} (file truncated?)")
    head = check_header(s.head, digest, length, csum)
    if target is not None:
        dst[:] = target[:length]
    elif length > full:
        dst[full:] = s.tail[:length - full]
    if checksum(dst, head.flags) != csum:
        raise CorruptBlockError("block payload checksum mismatch")


def copy_block(raw: np.ndarray, digest: bytes, length: int, csum: int, dst: np.ndarray) -> None:
    """Copy a block read earlier (``raw``: its header page and payload, as on disk) into
    ``dst`` (a writable flat ``uint8`` host view of ``length`` bytes) and verify it as
    :func:`read_block` does: the header names ``digest`` and agrees with the indexed
    ``length``/``csum``, and the copy in ``dst`` hashes to ``csum``. Raises
    :class:`CorruptBlockError` otherwise (``dst`` then holds unspecified bytes)."""
    if dst.nbytes != length or raw.nbytes < PAGE + length:
        raise CorruptBlockError(f"payload length {dst.nbytes} differs from the index's {length}")
    head = check_header(raw[:HEADER_BYTES], digest, length, csum)
    dst[:] = raw[PAGE:PAGE + length]
    if checksum(dst, head.flags) != csum:
        raise CorruptBlockError("block payload checksum mismatch")


# A run is one system call; the kernel cuts it into device requests of at most
# max_sectors_kb, so an 8 MiB run already keeps several requests in flight. Larger runs
# measured no faster; 256 blocks keeps two iovecs a block under IOV_MAX (1024).
MAX_RUN_BLOCKS = 256
MAX_RUN_BYTES = 8 << 20
# A read batch is cut into smaller runs: the calling thread checks each run as it lands
# while the I/O threads go on with the next ones, and with smaller runs less is left to
# check once the last transfer is done (1 MiB blocks: 1.06x with 2 MiB runs in per-batch
# interleaved A/Bs, level at 256 KiB and 4 MiB). Writes keep 8 MiB runs (2 MiB: 0.96x).
READ_RUN_BYTES = 2 << 20


def joinable(buf: np.ndarray) -> bool:
    """Whether a host view can be part of a run: page-aligned, a whole number of pages
    (so it is transferred in place, with no tail page to copy)."""
    n = buf.nbytes
    return n > 0 and n % PAGE == 0 and is_aligned(buf)


def plan_runs(items: list[tuple[object, int, int, bool]], max_blocks: int,
              max_bytes: int = MAX_RUN_BYTES) -> list[list[int]]:
    """Group blocks whose extents follow each other in one file into runs, so that one
    ``preadv``/``pwritev`` moves several blocks (fewer system calls and Python steps
    per block; the kernel splits a large transfer into several device requests).

    ``items[i]`` is ``(file, offset, payload nbytes, joinable)``; returns lists of
    indices into ``items``, each run in file order, at most ``max_blocks`` long and,
    unless it is one block, at most ``max_bytes`` of payload. A block that is not
    joinable is a run of its own."""
    runs: list[list[int]] = []
    order = sorted((i for i, it in enumerate(items) if it[3]), key=lambda i: (items[i][0], items[i][1]))
    run: list[int] = []
    end = nbytes = 0
    for i in order:
        file, offset, n, _ = items[i]
        if run and (items[run[-1]][0] != file or offset != end or len(run) >= min(max_blocks, MAX_RUN_BLOCKS)
                    or nbytes + n > max_bytes):
            runs.append(run)
            run, nbytes = [], 0
        run.append(i)
        end = offset + extent_bytes(n)
        nbytes += n
    if run:
        runs.append(run)
    runs += [[i] for i, it in enumerate(items) if not it[3]]
    return runs


def write_run(fd: int, offset: int, digests: list[bytes], payloads: list[np.ndarray], flags: int = 0,
              payload_checksums: list[int | None] | None = None) -> list[int]:
    """Write consecutive blocks (header page + payload each) from ``offset`` in one
    ``pwritev``; returns their checksums (of the kind ``flags`` selects; given ones in
    ``payload_checksums`` kept as they are). Payloads are :func:`joinable` host views owned
    by the caller, read only during the call. Errors as :func:`write_block`, for the
    whole run."""
    pages = _scratch.pages_of("out_pages", len(payloads))   # padding past 64 bytes stays zero
    iov: list[np.ndarray] = []
    sums = []
    total = 0
    given = payload_checksums or [None] * len(payloads)
    for page, digest, payload, csum in zip(pages, digests, payloads, given):
        csum = checksum(payload, flags) if csum is None else csum
        sums.append(encode_header(digest, payload, page[:HEADER_BYTES], payload_checksum=csum, flags=flags))
        iov += (page, payload)
        total += PAGE + payload.nbytes
    _write_all(fd, iov, offset, total)
    return sums


def read_run(fd: int, offset: int, blocks: list[tuple[bytes, int, int]], dsts: list[np.ndarray]
             ) -> list[CorruptBlockError | None]:
    """Read consecutive blocks from ``offset`` in one ``preadv`` straight into ``dsts``
    (:func:`joinable` writable host views of each block's length, owned by the caller)
    and verify each as :func:`read_block` does. ``blocks`` are ``(digest, length,
    checksum)``. Returns per block ``None`` (verified) or the :class:`CorruptBlockError`
    that rejects it; raises :class:`TierIOError` when the medium fails the whole read."""
    return check_run(offset, blocks, dsts, land_run(fd, offset, dsts))


def land_run(fd: int, offset: int, dsts: list[np.ndarray]) -> tuple[int, list[bytes]]:
    """The transfer half of :func:`read_run`: one ``preadv`` of the run into ``dsts``;
    returns the bytes read and each block's header (copied out of this thread's scratch
    pages, so another thread can check them while this one reads on). Nothing is
    verified yet: pass the result to :func:`check_run` before trusting ``dsts``."""
    pages = _scratch.pages_of("in_pages", len(dsts))
    iov: list[np.ndarray] = []
    for page, dst in zip(pages, dsts):
        iov += (page, dst)
    try:
        got = os.preadv(fd, iov, offset)
    except OSError as exc:
        raise io_error(f"read of {len(dsts)} blocks at offset {offset} failed", exc) from exc
    return got, [bytes(page[:HEADER_BYTES]) for page in pages[:len(dsts)]]


def check_run(offset: int, blocks: list[tuple[bytes, int, int]], dsts: list[np.ndarray],
              landed: tuple[int, list[bytes]]) -> list[CorruptBlockError | None]:
    """The verification half of :func:`read_run`, on what :func:`land_run` returned."""
    got, headers = landed
    out: list[CorruptBlockError | None] = []
    pos = 0
    for header, dst, (digest, length, csum) in zip(headers, dsts, blocks):
        pos += PAGE + length
        try:
            if dst.nbytes != length:
                raise CorruptBlockError(f"payload length {dst.nbytes} differs from header's {length}")
            if pos > got:
                raise CorruptBlockError(f"short read at offset {offset} (file truncated?)")
            head = check_header(header, digest, length, csum)
            if checksum(dst, head.flags) != csum:
                raise CorruptBlockError("block payload checksum mismatch")
            out.append(None)
        except CorruptBlockError as exc:
            out.append(exc)
    return out


def check_header(header, digest: bytes, length: int, csum: int) -> BlockHeader:
    """Parse a block's header and check it against the index's ``length``/``csum``;
    returns it (its ``flags`` say how to verify the payload). Raises
    :class:`CorruptBlockError`."""
    head = parse_block_header(header, digest=digest)
    if head.version != VERSION:
        raise CorruptBlockError(f"unsupported block format version {head.version} on NVMe")
    if head.length != length or head.checksum != csum:
        raise CorruptBlockError(f"block header (length {head.length}) disagrees with the index (length {length})")
    return head


def read_header(fd: int, offset: int) -> bytes | None:
    """The raw header page at ``offset`` (``None`` past end of file); for fsck scans."""
    page = _scratch.header
    try:
        got = os.preadv(fd, [page], offset)
    except OSError as exc:
        raise io_error(f"read at offset {offset} failed", exc) from exc
    return bytes(page[:HEADER_BYTES]) if got == PAGE else None


def open_data_file(path: str, *, direct: bool, create: bool) -> tuple[int, bool]:
    """Open a data file read-write, with ``O_DIRECT`` when asked and allowed.

    Returns ``(fd, direct)``; ``direct`` is False when the file system refused
    ``O_DIRECT`` (tmpfs, some overlay mounts), which the caller reports.
    """
    flags = os.O_RDWR | (os.O_CREAT if create else 0) | getattr(os, "O_CLOEXEC", 0)
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return os.open(path, flags, 0o600), False


def probe_direct(fd: int) -> bool:
    """Whether aligned ``O_DIRECT`` I/O works on ``fd`` (some file systems accept the
    flag at open and fail every transfer with EINVAL)."""
    page = aligned_empty(PAGE)
    try:
        os.preadv(fd, [page], 0)
        return True
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise


def verify_header_page(page: bytes, digest: bytes | None = None) -> tuple[int, int] | None:
    """``(length, checksum)`` when ``page`` holds a valid block header, else ``None``."""
    try:
        return parse_header(page[:HEADER_BYTES], digest=digest)
    except CorruptBlockError:
        return None
