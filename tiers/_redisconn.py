"""Connections of the redis tier: standalone or Cluster, credentials, TLS, routing of a
batch's keys to the node that owns their slot, start-up checks and the health probe.

redis-py (with hiredis where installed) owns every socket: connection pools per node,
the AUTH/ACL handshake, TLS and timeouts, and for a Cluster the slot map
(``CLUSTER SLOTS``) kept by its ``NodesManager``. The tier's own block I/O runs on those
connections (:mod:`tiers._redisio`). Thread-safe: pools and the slot map take their own
locks; :meth:`Endpoints.refresh` may run while batches are in flight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from concurrent.futures import Executor
from typing import Any, Callable, Sequence
from urllib.parse import unquote, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore.config.tiers import RedisTierConfig
from kvstore.errors import ConfigError
from kvstore.tiers import _redisio as rio

log = logging.getLogger(__name__)
FAULTS = (OSError, RedisError, rio.ProtocolViolation)   # a node or connection failed
_SCHEMES = {"redis": False, "valkey": False, "rediss": True, "valkeys": True}

_D = RedisTierConfig.defaults()   # the settings' defaults: the config model's (one definition)


@dataclass(frozen=True)
class RedisSettings:
    """What the tier connects with (see ``RedisTierConfig``); ``where`` names it in errors."""

    name: str
    url: str | None = _D.url
    nodes: tuple[str, ...] = ()
    cluster: str | bool = _D.cluster
    username: str | None = _D.username
    password: str | None = None
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    concurrency: int = _D.concurrency
    timeout_s: float = _D.timeout_s
    max_attempts: int = _D.max_attempts

    @property
    def where(self) -> str:
        return self.url or ",".join(self.nodes)


def parse_endpoints(s: RedisSettings) -> tuple[list[tuple[str, int]], bool, int]:
    """``([(host, port)…], tls, db)`` from ``url`` or ``nodes``; raises ConfigError."""
    field = f"tiers.{s.name}"
    if (s.url is None) == (not s.nodes):
        raise ConfigError(f"{field}: give exactly one of url or nodes")
    if s.url is not None:
        parts = urlsplit(s.url)
        if parts.scheme not in _SCHEMES:
            raise ConfigError(f"{field}.url: scheme must be redis://, rediss://, valkey:// or valkeys:// "
                              f"(got {s.url!r})")
        if parts.username or parts.password:
            raise ConfigError(f"{field}.url: put credentials in username / password / password_env, "
                              "not in the URL")
        try:
            port = parts.port or 6379
        except ValueError as exc:
            raise ConfigError(f"{field}.url: {exc} (got {s.url!r})") from None
        path = unquote(parts.path).strip("/")
        if path and not path.isdigit():
            raise ConfigError(f"{field}.url: the path may only name a database number (got {s.url!r})")
        if not parts.hostname:
            raise ConfigError(f"{field}.url: no host in {s.url!r}")
        return [(parts.hostname, port)], s.tls or _SCHEMES[parts.scheme], int(path or 0)
    endpoints = []
    for node in s.nodes:
        host, _, port = node.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{field}.nodes: each node is host:port (got {node!r})")
        endpoints.append((host.strip("[]"), int(port)))
    return endpoints, s.tls, 0


def _client_kwargs(s: RedisSettings, tls: bool) -> dict[str, Any]:
    kw: dict[str, Any] = dict(username=s.username, password=s.password, socket_timeout=s.timeout_s,
                              socket_connect_timeout=s.timeout_s, max_connections=4 * s.concurrency,
                              single_connection_client=False, protocol=2)   # tiers._redisio speaks RESP2
    if tls:
        kw.update(ssl=True, ssl_ca_certs=s.tls_ca, ssl_certfile=s.tls_cert, ssl_keyfile=s.tls_key,
                  ssl_cert_reqs="required" if s.tls_ca else "none")
    return kw


def startup_error(s: RedisSettings, exc: BaseException) -> ConfigError:
    """A failure at start-up, mapped to a ConfigError naming the setting to fix."""
    field, text = f"tiers.{s.name}", f"{type(exc).__name__}: {exc}"
    if isinstance(exc, AuthenticationError) or "WRONGPASS" in str(exc) or "invalid username-password" in str(exc):
        return ConfigError(f"{field}.password: {s.where} refused the credentials (username "
                           f"{s.username or 'default'!r}): {text}")
    if "NOAUTH" in str(exc):
        return ConfigError(f"{field}.password: {s.where} requires authentication; set username and "
                           f"password (or password_env): {text}")
    if isinstance(exc, NoPermissionError) or "NOPERM" in str(exc):
        return ConfigError(f"{field}.username: user {s.username or 'default'!r} lacks a permission the tier "
                           f"needs (GET/SET/DEL/GETRANGE/STRLEN/SCAN on its prefix): {text}")
    if "SSL" in str(exc) or "certificate" in str(exc):
        return ConfigError(f"{field}.tls: TLS handshake with {s.where} failed: {text}")
    key = "url" if s.url else "nodes"
    return ConfigError(f"{field}.{key}: cannot use {s.where}: {text}")


class Fault(Exception):
    """A node group's batch failed as a whole (connection, timeout, uncovered slot)."""


class Endpoints:
    """The servers behind the tier: one standalone server, or a Cluster's primaries.

    ``route(names)`` groups a batch by owning node: ``{node id: (pool, [index…])}``.
    """

    def __init__(self, settings: RedisSettings) -> None:
        self.settings = s = settings
        endpoints, tls, db = parse_endpoints(s)
        kw = _client_kwargs(s, tls)
        first, clustered = self._detect(endpoints, kw, db)
        if s.cluster is True and not clustered:
            raise ConfigError(f"tiers.{s.name}.cluster: {s.where} is not a Cluster node (cluster_enabled:0); "
                              "set cluster: false or auto")
        if s.cluster is False and clustered:
            raise ConfigError(f"tiers.{s.name}.cluster: {s.where} is a Cluster node; set cluster: true or auto")
        self.clustered = clustered
        if clustered:
            first.close()
            if db:
                raise ConfigError(f"tiers.{s.name}.url: a Cluster has only database 0")
            kw.pop("single_connection_client")
            try:
                self._cluster = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in endpoints],
                                             require_full_coverage=False, **kw)
            except RedisError as exc:
                raise startup_error(s, exc) from exc
            self._single = None
        else:
            self._cluster = None
            self._single = first

    def _detect(self, endpoints: list[tuple[str, int]], kw: dict, db: int) -> tuple[redis.Redis, bool]:
        """Connect to the first endpoint that answers; ``INFO cluster`` says the mode."""
        last: BaseException | None = None
        for host, port in endpoints:
            client = redis.Redis(host=host, port=port, db=db, **kw)
            try:
                info = client.info("cluster")
            except (AuthenticationError, NoPermissionError) as exc:
                client.close()
                raise startup_error(self.settings, exc) from exc
            except RedisError as exc:
                client.close()
                if isinstance(exc, ResponseError):
                    raise startup_error(self.settings, exc) from exc
                last = exc
                continue
            return client, bool(info.get("cluster_enabled"))
        assert last is not None
        raise startup_error(self.settings, last) from last

    # -- routing -------------------------------------------------------------------------

    def route(self, names: Sequence[bytes]) -> dict[str, tuple[Any, list[int]]]:
        """Indices of ``names`` grouped by the node owning each key's slot. A slot no
        node covers (failover in progress) raises ``SlotNotCoveredError``."""
        if self._cluster is None:
            return {"single": (self._single.connection_pool, list(range(len(names))))}
        groups: dict[str, tuple[Any, list[int]]] = {}
        manager, cluster = self._cluster.nodes_manager, self._cluster
        for i, name in enumerate(names):
            node = manager.get_node_from_slot(cluster.keyslot(name))
            group = groups.get(node.name)
            if group is None:
                group = groups[node.name] = (cluster.get_redis_connection(node).connection_pool, [])
            group[1].append(i)
        return groups

    def run(self, names: Sequence[bytes], build: Callable[[int], list], parse: Callable[[Any, int], Any],
            pool: Executor) -> list[Any]:
        """One pipelined batch: per index, ``parse``'s outcome, or a :class:`Fault` where
        that key's node failed. Each node's keys go in one pipeline on one pooled
        connection (``build(i)``: the request pieces of key ``i``), the nodes in parallel
        on ``pool``. A dropped connection is retried on a fresh one (``max_attempts`` in
        all), a timeout is not."""
        try:
            groups = self.route(names)
        except FAULTS as exc:  # an uncovered slot: failover in progress
            return [Fault(f"{type(exc).__name__}: {exc}")] * len(names)
        out: list[Any] = [None] * len(names)
        attempts = self.settings.max_attempts

        def one(conns: Any, idx: list[int]) -> None:
            for attempt in range(attempts):
                try:
                    conn = conns.get_connection()
                except FAULTS as exc:
                    fault: BaseException = exc
                else:
                    try:
                        got = rio.run_batch(conn, [p for i in idx for p in build(i)],
                                            lambda r: [parse(r, i) for i in idx])
                    except FAULTS as exc:
                        fault = exc
                    else:
                        for i, o in zip(idx, got):
                            out[i] = o
                        return
                    finally:
                        conns.release(conn)
                if isinstance(fault, (TimeoutError, RedisTimeoutError)):
                    break
            marker = Fault(f"{type(fault).__name__}: {fault}")
            for i in idx:
                out[i] = marker

        work = list(groups.values())
        if len(work) == 1:
            one(*work[0])
        else:
            list(pool.map(lambda g: one(*g), work))
        return out

    def primaries(self) -> list[redis.Redis]:
        """A client per server holding data (SCAN runs on each)."""
        if self._cluster is None:
            return [self._single]
        return [self._cluster.get_redis_connection(node) for node in self._cluster.get_primaries()]

    def refresh(self) -> None:
        """Reload a Cluster's slot map (after MOVED/ASK or a failed node)."""
        if self._cluster is not None:
            self._cluster.nodes_manager.initialize()

    def probe(self) -> None:
        """Raise unless every server holding data answers: standalone PING; Cluster:
        reload the slot map, every slot covered, every primary answers PING."""
        if self._cluster is None:
            self._single.ping()
            return
        self.refresh()
        manager = self._cluster.nodes_manager
        if any(not manager.slots_cache.get(slot) for slot in range(16384)):
            raise ConnectionError("cluster slots not fully covered (failover in progress)")
        for client in self.primaries():
            info = client.execute_command("CLUSTER INFO")
            text = info if isinstance(info, (bytes, str)) else "\n".join(f"{k}:{v}" for k, v in info.items())
            if "cluster_state:ok" not in (text.decode() if isinstance(text, bytes) else text):
                raise ConnectionError("a primary reports the cluster down (cluster_state is not ok)")

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.close()
        if self._single is not None:
            self._single.close()
