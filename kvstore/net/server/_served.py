"""The served Store as the server's data paths see it (TCP, same-host, NIXL): the Store,
whether its first tier can lend views of its bytes, and the keys interned across
requests. One per server. :meth:`ServedStore.intern` runs on the event loop thread only;
:meth:`ServedStore.borrow` also in the loop's executor (NIXL), as the Store's borrow may.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Sequence

_INTERN_MAX = 1 << 16   # interned keys kept (about 25 MiB at most)


class ServedStore:
    """``store`` (not owned: the server closes it). ``borrowable``: the first tier is
    host memory that lends zero-copy views, which zero-copy sends, the shared arena and
    NIXL need."""

    def __init__(self, store: Any) -> None:
        self.store = store
        caps = store.tiers[0].capabilities
        self.borrowable = caps.device == "cpu" and caps.zero_copy_view
        self._interned: dict[bytes, Any] = {}

    def intern(self, keys: list[Any]) -> list[Any]:
        """The same key objects for the same digests, request after request: the Store's
        dicts then match a looked-up key by identity instead of calling ``__eq__`` on
        every probe (several per key per request). Bounded; cleared when full."""
        cache = self._interned
        if len(cache) > _INTERN_MAX:
            cache.clear()
        return [cache.setdefault(k.digest, k) for k in keys]

    def borrow(self, keys: Sequence[Any], offsets: bool = False) -> Any:
        """The first tier's blocks, unverified here: every caller sends the Store's
        ``checksums`` with them and the client verifies the bytes it receives (one hash
        per block, on the reader's side, instead of two). All ``None`` (misses) when
        the first tier cannot lend views."""
        if self.borrowable:
            return self.store.borrow(keys, offsets=offsets, verify=False)
        return nullcontext([None] * len(keys))


__all__ = ["ServedStore"]
