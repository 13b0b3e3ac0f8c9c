"""Object I/O of the S3 tier: one object per block, a version-2 block header
(``EXT_HEADER_BYTES``: key digest, length, checksum, parent digest) followed by the
payload, and no user metadata. Objects written before the parent moved into the body
(version-1 header of ``HEADER_BYTES``, parent in ``x-amz-meta-kv-parent``) still read.

Single-object requests go through :class:`tiers.s3.http.ObjectRequests` (the boto3
client's signer and pool without botocore's per-call pipeline); multipart uploads through
the client. Reads stream straight into caller memory: the urllib3 response sits on an
``http.client`` response whose ``readinto`` receives from the socket into the buffer it
is given, so a block crosses from the kernel into the destination once, with no ``bytes``
of the whole block in between. Writes send reusable ``bytearray`` buffers that hold
header + payload (one per part for multipart uploads). Functions here are stateless and thread-safe; they raise botocore /
transport exceptions as they come and :class:`CorruptBlockError` for bad content.
"""

from __future__ import annotations

import http.client
from concurrent.futures import Executor
from typing import Any

from kvstore.block import (EXT_HEADER_BYTES, EXT_VERSION, HEADER_BYTES, checksum, header_size, parse_any_header,
                           parse_extension)
from kvstore.errors import CorruptBlockError
from kvstore.keys import DIGEST_BYTES, BlockKey
from kvstore.tiers.base import buffer_size_error
from kvstore.tiers.s3.http import ObjectRequests

NO_NAMESPACE = "_"   # path segment for keys without a namespace digest
LEGACY_META_PARENT = "kv-parent"  # version-1 objects: parent digest (hex) in x-amz-meta-kv-parent
_HEX = 2 * DIGEST_BYTES


def object_name(prefix: str, key: BlockKey) -> str:
    """``<prefix>/<namespace digest hex>/<key digest hex>``."""
    ns = key.namespace.hex() if key.namespace else NO_NAMESPACE
    return f"{prefix}/{ns}/{key.hex()}" if prefix else f"{ns}/{key.hex()}"


def parse_name(prefix: str, name: str) -> tuple[str | None, str] | None:
    """``(namespace hex or None, key hex)`` of an object name, ``None`` for foreign objects."""
    rest = name[len(prefix) + 1:] if prefix else name
    if prefix and not name.startswith(prefix + "/"):
        return None
    parts = rest.split("/")
    if len(parts) != 2 or len(parts[1]) != _HEX or not _is_hex(parts[1]):
        return None
    ns = parts[0]
    if ns == NO_NAMESPACE:
        return None, parts[1]
    return (ns, parts[1]) if len(ns) == _HEX and _is_hex(ns) else None


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
        return True
    except ValueError:
        return False


# -- reads ---------------------------------------------------------------------------------

def _read_exact(body: Any, dst: memoryview) -> None:
    """Fill ``dst`` from a urllib3 response, straight from the socket."""
    n, got = dst.nbytes, 0
    fp = getattr(body, "_fp", None)
    readinto = fp.readinto if isinstance(fp, http.client.HTTPResponse) else body.readinto
    while got < n:
        k = readinto(dst[got:])
        if not k:
            raise http.client.IncompleteRead(b"", n - got)
        got += k


def _finish(body: Any, complete: bool) -> None:
    """Return the connection to the pool after a fully read body; drop it otherwise."""
    fp = getattr(body, "_fp", None)
    if not (complete and (fp is None or fp.isclosed())):
        body.close()
    body.release_conn()


def _length(resp: Any) -> int:
    """The reply's Content-Length. A reply without one says nothing about the object, so
    it is an I/O failure (counted, retried later), never a corrupt object to delete."""
    value = resp.headers.get("Content-Length", "")
    if not value.isdigit():
        raise ValueError(f"S3 reply without a valid Content-Length ({value!r})")
    return int(value)


def _size_of(resp: Any) -> int:
    """The whole object's size from a ranged reply (its Content-Range), else its length."""
    size = resp.headers.get("Content-Range", "").rpartition("/")[2]
    return int(size) if size.isdigit() else _length(resp)


def read_header(body: Any, name: str, key: BlockKey, total: int) -> tuple[int, int, int, bytes | None]:
    """Read and verify an object's block header from ``body`` (an object of ``total``
    bytes). Returns ``(header bytes, payload length, payload checksum, parent digest)``;
    the parent is ``None`` for a first chunk and for version-1 objects (whose parent is
    in metadata)."""
    if total < HEADER_BYTES:
        raise CorruptBlockError(f"object {name} has {total} bytes, shorter than a block header")
    header = bytearray(EXT_HEADER_BYTES)
    view = memoryview(header)
    _read_exact(body, view[:HEADER_BYTES])
    version, length, csum = parse_any_header(header, digest=key.digest)
    hb, parent = header_size(version), None
    if version == EXT_VERSION:
        if total < hb:
            raise CorruptBlockError(f"object {name} has {total} bytes, shorter than its block header")
        _read_exact(body, view[HEADER_BYTES:])
        parent = parse_extension(header)
    if total != hb + length:
        raise CorruptBlockError(f"object {name} has {total - hb} payload bytes, header says {length}")
    return hb, length, csum, parent


def get_into(requests: ObjectRequests, name: str, key: BlockKey, dst: memoryview, known_nbytes: int | None) -> int:
    """GET a whole object: parse and check its header, then stream the payload into
    ``dst`` and verify it. Returns the header size (so ranged reads know where the
    payload starts). ``dst`` holds unspecified bytes when this raises.

    Raises :class:`BufferSizeError` (before touching ``dst``) when the block's size is
    learnt only from the header and differs from ``dst``; :class:`CorruptBlockError` when
    the object is not the block it claims to be.
    """
    resp = requests.get(name)
    body = resp.raw
    complete = False
    try:
        hb, length, csum, _ = read_header(body, name, key, _length(resp))
        if length != dst.nbytes:
            if known_nbytes is not None:
                raise CorruptBlockError(f"object {name} holds {length} bytes, {known_nbytes} were written")
            raise buffer_size_error(dst.nbytes, length)
        _read_exact(body, dst)
        complete = True
    finally:
        _finish(body, complete)
    if checksum(dst) != csum:
        raise CorruptBlockError(f"object {name}: payload checksum mismatch")
    return hb


def get_header(requests: ObjectRequests, name: str, key: BlockKey) -> tuple[int, int, bytes | None]:
    """One small ranged GET of an object's block header: ``(header bytes, payload
    length, parent digest)``, all verified; the parent of a version-1 object comes from
    its metadata (sent with the same response)."""
    resp = requests.get(name, first=0, last=EXT_HEADER_BYTES - 1)
    body = resp.raw
    complete = False
    try:
        hb, length, _, parent = read_header(body, name, key, _size_of(resp))
        rest = _length(resp) - hb  # a version-1 header leaves payload bytes in the range
        if rest > 0:
            _read_exact(body, memoryview(bytearray(rest)))
        complete = True
    finally:
        _finish(body, complete)
    if hb == HEADER_BYTES:
        legacy = resp.headers.get(f"x-amz-meta-{LEGACY_META_PARENT}")
        try:
            parent = bytes.fromhex(legacy) if legacy else None
        except ValueError:
            parent = None
        if parent is not None and len(parent) != DIGEST_BYTES:
            parent = None
    return hb, length, parent


def get_ranges_into(requests: ObjectRequests, name: str, key: BlockKey, dst: memoryview, part_size: int,
                    pool: Executor, hb: int = EXT_HEADER_BYTES) -> None:
    """GET one large object whose header is ``hb`` bytes as parallel ranged requests
    straight into slices of ``dst`` (size already known to match), then verify header,
    length and checksum."""
    total = hb + dst.nbytes
    header = bytearray(hb)
    step = -(-total // -(-total // part_size))  # equal ranges, none a runt of a few bytes
    ranges = [(a, min(a + step, total)) for a in range(0, total, step)]
    futures = [pool.submit(_get_range, requests, name, a, b, total, memoryview(header), dst)
               for a, b in ranges]
    first: BaseException | None = None
    for fut in futures:  # wait for every part: none may still write into dst afterwards
        exc = fut.exception()
        if exc is not None and (first is None or isinstance(exc, CorruptBlockError)):
            first = exc
    if first is not None:
        raise first
    version, length, csum = parse_any_header(header, digest=key.digest)
    if header_size(version) != hb:
        raise CorruptBlockError(f"object {name} has a version-{version} header, expected {hb} header bytes")
    if version == EXT_VERSION:
        parse_extension(header)
    if length != dst.nbytes:
        raise CorruptBlockError(f"object {name} holds {length} bytes, {dst.nbytes} were written")
    if checksum(dst) != csum:
        raise CorruptBlockError(f"object {name}: payload checksum mismatch")


def _get_range(requests: ObjectRequests, name: str, a: int, b: int, total: int, header: memoryview,
               dst: memoryview) -> None:
    resp = requests.get(name, first=a, last=b - 1)
    body = resp.raw
    complete = False
    try:
        size = _size_of(resp)
        if _length(resp) != b - a or size != total:
            raise CorruptBlockError(f"object {name} has size {size}, expected {total}")
        hb = header.nbytes
        if a < hb:
            _read_exact(body, header[a:min(b, hb)])
        if b > hb:
            lo = max(a, hb) - hb
            _read_exact(body, dst[lo:b - hb])
        complete = True
    finally:
        _finish(body, complete)


# -- writes --------------------------------------------------------------------------------

def put_multipart(client: Any, bucket: str, name: str, parts: list[bytearray], pool: Executor) -> None:
    """Multipart upload of ``parts`` (header + payload, in order) sent in parallel on
    ``pool``; the upload is aborted when any part fails, so no partial object appears."""
    upload = client.create_multipart_upload(Bucket=bucket, Key=name)["UploadId"]
    try:
        futures = [pool.submit(client.upload_part, Bucket=bucket, Key=name, UploadId=upload,
                               PartNumber=i + 1, Body=part, ContentLength=len(part))
                   for i, part in enumerate(parts)]
        errors = [f.exception() for f in futures]
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            raise failed
        done = [{"PartNumber": i + 1, "ETag": f.result()["ETag"]} for i, f in enumerate(futures)]
        client.complete_multipart_upload(Bucket=bucket, Key=name, UploadId=upload,
                                         MultipartUpload={"Parts": done})
    except BaseException:
        try:
            client.abort_multipart_upload(Bucket=bucket, Key=name, UploadId=upload)
        except Exception:  # the endpoint may be gone; the bucket's lifecycle rules reap it
            pass
        raise
