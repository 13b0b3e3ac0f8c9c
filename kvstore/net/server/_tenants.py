"""Tenants of the cache server (``server.tenants``; ``docs/server.md``, Tenants): which
tenant a connection is, and the key space everything it does lives in.

A HELLO proof is checked against every tenant's token (all of them, each compared in
constant time), and the one it matches is the connection's tenant. From then on every
key and namespace digest the client sends is mapped into that tenant's space before
the Store sees it: :meth:`Tenant.scope` runs once per request on its decoded arguments,
in the connection's read loop, ahead of every op's handler (an op it does not know is
refused, never passed through). So a tenant can neither read, see, lease, hint nor
delete another tenant's block, even under the same client key (the same content hash),
and nothing it gets back names another tenant's keys.

The mapping (fixed; ``docs/server.md`` states it too), HKDF-SHA256 (RFC 5869) from the
tenant's ``salt``, then HMAC-SHA256 per 32-byte digest::

    prk    = HMAC-SHA256(key=b"kvstore/tenant/v1", msg=UTF-8(salt))   # HKDF-Extract
    k_map  = HMAC-SHA256(prk, b"key-map" || 0x01)                     # HKDF-Expand, 32 bytes
    tag    = HMAC-SHA256(prk, b"tag" || 0x01)[:8]                     # HKDF-Expand, 8 bytes
    map(d) = tag || HMAC-SHA256(k_map, d)[:24]

applied to a key's digest, its parent's and its namespace's, so a mapped key's parent is
its mapped parent (prefix-aware eviction sees the same chains) and a CLEAR of namespaces
finds the tenant's own. ``tag`` names the owner for the Store's per-tenant accounting
(:mod:`kvstore.store.tenants`). Two tenants' spaces meet only where HMAC-SHA256 under two
keys collides, so isolation does not rest on the salts being secret.

Without ``server.tenants`` there is one tenant, ``default``, whose keys are not mapped:
the server behaves as it always did.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Mapping, Sequence

from kvstore.store.tenants import TAG_BYTES, TenantLedger
from kvstore.config import ServerConfig
from kvstore.errors import ConfigError, ProtocolError
from kvstore.keys import BlockKey, _trusted
from kvstore.net import protocol as P
from kvstore.net.auth import hello_proof

_KDF_SALT = b"kvstore/tenant/v1"
_CACHE_MAX = 1 << 16       # mapped keys kept per tenant (as ServedStore.intern keeps)
DEFAULT = "default"        # the tenant of server.token

# Every op, by where its arguments carry keys (a new op must be added here, or it is refused).
_KEYS_ARG = frozenset({P.Op.CONTAINS, P.Op.DELETE, P.Op.RELEASE})            # keys
_KEYS_SECOND = frozenset({P.Op.LOOKUP, P.Op.HINT})                            # (x, keys)
_KEYS_FIRST = frozenset({P.Op.GET, P.Op.PUT, P.Op.SHM_GET, P.Op.SHM_PUT, P.Op.SHM_RESERVE})  # (keys, rec)
_KEYS_THIRD = frozenset({P.Op.NIXL_GET, P.Op.NIXL_PUT, P.Op.LOOKUP_WAIT})   # (kind, device, keys, rec), (lease, wait, keys)
# No keys: a reservation or lease id names state this connection made with its mapped keys.
KEYLESS = frozenset({P.Op.HELLO, P.Op.PING, P.Op.STATS, P.Op.SHM_ATTACH, P.Op.SHM_DONE, P.Op.SHM_COMMIT,
                     P.Op.NIXL_HELLO})
SCOPED = _KEYS_ARG | _KEYS_SECOND | _KEYS_FIRST | _KEYS_THIRD | {P.Op.CLEAR}


def _hkdf(salt: str) -> tuple[bytes, bytes]:
    """``(k_map, tag)`` of a tenant's salt."""
    prk = hmac.digest(_KDF_SALT, salt.encode("utf-8"), hashlib.sha256)
    return (hmac.digest(prk, b"key-map\x01", hashlib.sha256),
            hmac.digest(prk, b"tag\x01", hashlib.sha256)[:TAG_BYTES])


class Tenant:
    """One tenant: its token, its key space (``salt``; ``None``: keys as sent) and its
    quota per tier. Its caches and counters are touched on the event loop only."""

    def __init__(self, name: str, token: str | None, salt: str | None,
                 quota: Mapping[str, int] | None = None, *, operator: bool = False) -> None:
        self.name, self.token, self.quota = name, token, dict(quota or {})
        self.operator = operator     # the admin port's /clear and the full /stats (server.token)
        self.mapped = salt is not None
        k_map, self.tag = _hkdf(salt) if salt is not None else (b"", b"")
        self._mac = hmac.new(k_map, digestmod=hashlib.sha256)   # copied per digest: no key setup each time
        self._keys: dict[bytes, BlockKey] = {}
        self._namespaces: dict[bytes, bytes] = {}
        self.hits = self.misses = 0

    # -- the key space -----------------------------------------------------------------------

    def digest(self, d: bytes) -> bytes:
        """``map(d)`` of one 32-byte digest (the module docstring)."""
        mac = self._mac.copy()
        mac.update(d)
        return self.tag + mac.digest()[:32 - TAG_BYTES]

    def namespace(self, ns: bytes) -> bytes:
        cache = self._namespaces
        out = cache.get(ns)
        if out is None:
            if len(cache) > 1024:
                cache.clear()
            out = cache[ns] = self.digest(ns)
        return out

    def keys(self, keys: Sequence[BlockKey], *, cached: bool = True) -> list[BlockKey]:
        """The Store's keys for a client's keys (the same objects for the same digests,
        request after request, as :meth:`ServedStore.intern` keeps them). ``cached=False``
        off the event loop (the admin port's lookup)."""
        if not self.mapped:
            return list(keys)
        cache = self._keys if cached else {}
        if len(cache) > _CACHE_MAX:
            cache.clear()
        out = []
        digest = self.digest
        namespace = self.namespace if cached else digest
        last: tuple[bytes, bytes] | None = None   # a chain's parent is the key before it: mapped once
        for k in keys:
            m = cache.get(k.digest)
            if m is None:
                parent = k.parent
                if parent is not None:
                    parent = last[1] if last is not None and last[0] == parent else digest(parent)
                m = cache[k.digest] = _trusted(digest(k.digest), parent,
                                               namespace(k.namespace) if k.namespace is not None else None)
            last = (k.digest, m.digest)
            out.append(m)
        return out

    def owns(self, key: BlockKey) -> bool:
        """Whether a stored key is in this tenant's space (every key, unmapped)."""
        return not self.mapped or key.digest[:TAG_BYTES] == self.tag

    def scope(self, op: P.Op, args: Any) -> Any:
        """A request's decoded arguments with every key and namespace in this tenant's
        space. Refuses an op it has no rule for, so none can reach the Store unmapped."""
        if not self.mapped or op in KEYLESS:
            return args
        if op in _KEYS_FIRST:
            return (self.keys(args[0]), *args[1:])
        if op in _KEYS_SECOND:
            return (args[0], self.keys(args[1]))
        if op in _KEYS_ARG:
            return self.keys(args)
        if op in _KEYS_THIRD:
            return (args[0], args[1], self.keys(args[2]), *args[3:])
        if op is P.Op.CLEAR:
            return [self.namespace(ns) for ns in args]
        raise ProtocolError(f"{getattr(op, 'name', op)} has no tenant scope on this server")

    # -- counters --------------------------------------------------------------------------

    def served(self, sizes: Sequence[int]) -> None:
        """One GET's outcome per key: a size is a hit, a miss or size mismatch a miss
        (NIXL's ``NOT_SENT`` is neither: the client's GET that follows counts it)."""
        hits = sum(1 for s in sizes if s > 0)
        self.hits += hits
        self.misses += sum(1 for s in sizes if s in (P.MISS, P.SIZE_MISMATCH))


class Tenants:
    """The tenants of one server, from ``server.tenants`` and ``server.token``."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.enabled = bool(cfg.tenants)
        if not self.enabled:   # one tenant, keys as sent: the server as it always was
            self.all = [Tenant(DEFAULT, cfg.token, None, operator=True)]
            return
        self.all = [Tenant(t.name, t.token, t.salt, t.quota) for t in cfg.tenants]
        if cfg.token is not None:
            self.all.insert(0, Tenant(DEFAULT, cfg.token, "", operator=True))
        tags = [t.tag for t in self.all]
        if len(set(tags)) != len(tags):     # 2**-64 per pair; checked all the same
            raise ConfigError("server.tenants: two salts derive the same tenant tag; change one salt")

    @property
    def open(self) -> bool:
        """No token and no tenants: no authentication."""
        return not self.enabled and self.all[0].token is None

    def authenticate(self, nonce: bytes, client: Any, proof: Any) -> Tenant | None:
        """The tenant whose token ``proof`` answers ``nonce`` with (every tenant's is
        computed and compared in constant time, so the time taken names none), or None."""
        if self.open:
            return self.all[0]
        if not isinstance(client, str) or not isinstance(proof, str):
            return None
        given = proof.encode("utf-8", "replace")
        found = None
        for tenant in self.all:
            if hmac.compare_digest(given, hello_proof(tenant.token, nonce, client).encode()) and found is None:
                found = tenant
        return found

    def bearer(self, authorization: str) -> Tenant | None:
        """The tenant of an admin request's ``Authorization: Bearer <token>`` header
        (constant-time compare against every token), or None."""
        if self.open:
            return self.all[0]
        given = authorization[len("Bearer "):].strip() if authorization.startswith("Bearer ") else ""
        if not given:
            return None
        raw = given.encode("utf-8", "replace")
        found = None
        for tenant in self.all:
            if hmac.compare_digest(raw, tenant.token.encode()) and found is None:
                found = tenant
        return found

    def ledger(self, tiers: Sequence[str]) -> TenantLedger:
        """The Store-side accounting of these tenants over ``tiers`` (names, fastest first)."""
        index = {name: i for i, name in enumerate(tiers)}
        quotas = {}
        for t in self.all:
            missing = sorted(set(t.quota) - set(index))
            if missing:
                raise ConfigError(f"server.tenants ({t.name}).quota: no tier named {', '.join(missing)} in the "
                                  f"served Store (tiers: {', '.join(tiers)})")
            quotas[t.name] = {index[tier]: nbytes for tier, nbytes in t.quota.items()}
        return TenantLedger({t.tag: t.name for t in self.all}, quotas, tiers)

    def stats(self, store_tenants: Mapping[str, Any], tenant: Tenant | None = None) -> dict[str, Any]:
        """Per tenant: the Store's bytes, blocks, quotas and evictions per tier, with the
        server's hits and misses; only ``tenant``'s own entry unless it is the operator."""
        out = {}
        for t in self.all:
            if tenant is not None and not tenant.operator and t is not tenant:
                continue
            out[t.name] = {"hits": t.hits, "misses": t.misses, **store_tenants.get(t.name, {"tiers": {}})}
        return out


def clear(store: Any, tenant: Tenant, namespaces: list[bytes]) -> int:
    """CLEAR for ``tenant``: its blocks of ``namespaces`` (already mapped), or all of its
    blocks (the whole Store for an unmapped tenant)."""
    if namespaces:
        wanted = set(namespaces)
        doomed = {key for tier in store.tiers for key in tier.keys()
                  if key.namespace in wanted and tenant.owns(key)}
    elif not tenant.mapped:
        return store.clear()
    else:
        doomed = {key for tier in store.tiers for key in tier.keys() if tenant.owns(key)}
    return store.delete(list(doomed)) if doomed else 0


def admin_clear(store: Any, tenant: Tenant) -> int:
    """The admin port's ``POST /clear``: everything for the operator (``server.token``,
    or a server without tenants), else the bearer tenant's own blocks."""
    return store.clear() if tenant.operator else clear(store, tenant, [])


__all__ = ["DEFAULT", "KEYLESS", "SCOPED", "Tenant", "Tenants", "admin_clear", "clear"]
