"""A tier backed by a kvstore cache server, so a node-local Store can stack a shared
server beneath it (``kind: remote``).

``capacity_bytes`` is this tier's quota on the server: the local Store evicts into it
as into any tier, and the tier refuses writes past the quota. The server runs its own
eviction too, so a block this tier wrote can disappear; a read then misses and the
Store drops it from its index. Every block is verified end to end (the client checks
the server's per-block checksum); ``tls`` puts the TCP connections in TLS
(``Client(tls=...)``); same-host clients copy from the server's own memory.

Thread-safe: the client pools connections; the local accounting runs under a lock.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Sequence

from kvstore.buffers import nbytes_of
from kvstore.config.tiers import RemoteTierConfig
from kvstore.errors import BufferSizeError, KVStoreError, TierIOError, TierUnavailableError
from kvstore.keys import BlockKey
from kvstore.tiers.base import Tier, TierCapabilities, buffer_size_error, check_batch, given_checksums

_D = RemoteTierConfig.defaults()   # keyword defaults: the config model's (one definition)


class RemoteTier(Tier):
    """Blocks on a kvstore server at ``address`` (``host:port`` or a socket path)."""

    def __init__(self, address: str, capacity_bytes: int, *, name: str = "remote", token: str | None = _D.token,
                 timeout_s: float = _D.timeout_s, client: Any = None, tls: Any = _D.tls) -> None:
        from kvstore.net.client import Client

        self.name = name
        self._capacity = int(capacity_bytes)
        try:
            self._client = client if client is not None else Client(address, token=token, timeout_s=timeout_s,
                                                                    tls=tls)
        except TierUnavailableError as exc:
            raise TierUnavailableError(str(exc), tier=name) from exc
        self._sizes: dict[BlockKey, int] = {}
        self._used = 0
        self._lock = threading.Lock()
        self.capabilities = TierCapabilities(device="remote", persistent=False, alignment=1, max_concurrency=8,
                                             write_checksums=True)

    def nbytes(self, key: BlockKey) -> int | None:
        return self._sizes.get(key)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return self._call(self._client.contains, list(keys))

    def read_into(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> list[bool]:
        check_batch(keys, dsts)
        for key, dst in zip(keys, dsts):
            size = self._sizes.get(key)
            if size is not None and nbytes_of(dst) != size:
                raise buffer_size_error(nbytes_of(dst), size, self.name)
        ok = self._call(lambda: self._client.load(list(keys), list(dsts)).result())
        gone = [k for k, hit in zip(keys, ok) if not hit]
        if gone:  # evicted by the server: stop counting it against the quota
            self._forget(gone)
        return ok

    def write(self, keys: Sequence[BlockKey], srcs: Sequence[Any],
              checksums: Sequence[int | None] | None = None) -> list[bool]:
        """See :meth:`Tier.write`; ``checksums`` (the writer's XXH3-64 per source, as a
        spill from DRAM hands them) are sent as the blocks' checksums, so the server
        refuses a source changed since its writer hashed it."""
        check_batch(keys, srcs)
        sums = given_checksums(keys, checksums)
        out = [False] * len(keys)
        todo: list[int] = []
        with self._lock:
            reserved = 0
            for j, (key, src) in enumerate(zip(keys, srcs)):
                if key in self._sizes:
                    out[j] = True
                elif self._used + reserved + nbytes_of(src) <= self._capacity:
                    todo.append(j)
                    reserved += nbytes_of(src)
            self._used += reserved
        if not todo:
            return out
        try:
            ok = self._call(lambda: self._client.save([keys[j] for j in todo], [srcs[j] for j in todo],
                                                      checksums=[sums[j] for j in todo]).result())
        except BaseException:
            with self._lock:
                self._used -= reserved
            raise
        with self._lock:
            self._used -= reserved
            for j, good in zip(todo, ok):
                key = keys[j]
                if good and key not in self._sizes:
                    self._sizes[key] = nbytes_of(srcs[j])
                    self._used += self._sizes[key]
                out[j] = out[j] or good
        return out

    def delete(self, keys: Sequence[BlockKey]) -> int:
        known = [k for k in keys if k in self._sizes]
        if known:
            self._call(self._client.delete, known)
        return self._forget(known)

    def _forget(self, keys: Sequence[BlockKey]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                size = self._sizes.pop(key, None)
                if size is not None:
                    self._used -= size
                    removed += 1
        return removed

    def keys(self) -> Iterator[BlockKey]:
        with self._lock:
            return iter(list(self._sizes))

    def stats(self) -> dict[str, Any]:
        return {"address": str(self._client.address), "transport": self._client.transport,
                "tls": bool(getattr(self._client, "tls", False))}

    def close(self) -> None:
        self._client.close()

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (BufferSizeError, TierUnavailableError):
            raise
        except ConnectionError as exc:
            raise TierUnavailableError(str(exc), tier=self.name) from exc
        except KVStoreError as exc:
            raise TierIOError(f"server error: {exc}", tier=self.name) from exc
