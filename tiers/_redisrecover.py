"""Key names and start-up recovery of the redis tier: parsing ``SCAN`` results back into
keys, and the per-key requests that rebuild an entry without reading its payload
(``GETRANGE`` of the block header, ``STRLEN``, ``OBJECT IDLETIME``). Stateless."""

from __future__ import annotations

from typing import Any

from kvstore.block import EXT_HEADER_BYTES, EXT_VERSION, header_size, parse_block_header, parse_extension
from kvstore.errors import CorruptBlockError
from kvstore.keys import DIGEST_BYTES, BlockKey
from kvstore.tiers import _redisio as rio

NO_NAMESPACE = "_"   # name segment for keys without a namespace digest
_HEX = 2 * DIGEST_BYTES
_HEXDIGITS = frozenset("0123456789abcdef")


def parse_name(prefix: str, name: bytes | str) -> BlockKey | None:
    """The key (without parent) named ``<prefix>:<namespace hex>:<key hex>``; ``None`` for
    anything else under the prefix."""
    text = name.decode("ascii", "replace") if isinstance(name, bytes) else name
    head, _, rest = text.partition(":")
    if head != prefix:
        return None
    ns, _, digest = rest.partition(":")
    if len(digest) != _HEX or not set(digest) <= _HEXDIGITS:
        return None
    if ns == NO_NAMESPACE:
        return BlockKey(bytes.fromhex(digest))
    if len(ns) != _HEX or not set(ns) <= _HEXDIGITS:
        return None
    return BlockKey(bytes.fromhex(digest), namespace=bytes.fromhex(ns))


def header_requests(name: bytes) -> list[bytes]:
    return [rio.pack(b"GETRANGE", name, b"0", b"%d" % (EXT_HEADER_BYTES - 1)),
            rio.pack(b"STRLEN", name), rio.pack(b"OBJECT", b"IDLETIME", name)]


def read_header_replies(reader: rio.Reader, _i: int) -> Any:
    """``(header bytes, strlen, idle seconds)``, ``None`` when the key is gone, or the
    first reply error that says a node cannot serve it (MOVED, CLUSTERDOWN …)."""
    header, strlen, idle = reader.reply(), reader.reply(), reader.reply()
    for reply in (header, strlen):
        if isinstance(reply, rio.ReplyError):
            return reply
    if strlen == 0:
        return None
    # OBJECT IDLETIME is refused under an LFU maxmemory policy: then no age is known.
    return header, strlen, idle if isinstance(idle, int) else 0


def check_header(replies: tuple[bytes, int, int], digest: bytes) -> tuple[int, bytes | None, int]:
    """``(payload bytes, parent digest or None, idle seconds)``; raises
    :class:`CorruptBlockError` for a value that is not this key's block."""
    header, strlen, idle = replies
    head = parse_block_header(header, digest=digest)
    parent = None
    if head.version == EXT_VERSION:
        parent = parse_extension(header)
    if strlen != header_size(head.version) + head.length:
        raise CorruptBlockError(f"value has {strlen} bytes, header says {header_size(head.version)} + {head.length}")
    return head.length, parent, idle
