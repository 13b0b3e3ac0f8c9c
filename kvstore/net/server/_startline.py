"""The line ``kvstore serve`` prints on stdout once it listens (:func:`start_line`):
its addresses first, in the ``key=value`` tokens scripts and tests parse
(``serving on HOST:PORT admin=PORT socket=PATH shm=PATH``), then what it serves: the
shared-memory arena's size, and each tier with its kind, capacity, where its data
lives and, for persistent tiers, the blocks recovered at start."""

from __future__ import annotations

from typing import Any

from kvstore.config.base import format_size


def start_line(server: Any) -> str:
    """The start line of ``server`` (a started :class:`kvstore.net.server.Server`), e.g.
    ``kvstore: serving on 127.0.0.1:7480 admin=7481 socket=/tmp/kvstore-7480-1.sock
    shm=/dev/shm/kvstore-1-ab12cd34 (1 GiB) tiers=[hot(dram, 1 GiB), disk(nvme, 8 GiB,
    /srv/kvstore-data, 12 blocks recovered)] tls=off``."""
    cfg = server.config
    arena = server.arena
    shm = f"{arena.path} ({format_size(arena.nbytes)})" if arena is not None else "None"
    stats = {t["name"]: t for t in server.store.stats()["tiers"]}
    tiers = ", ".join(describe_tier(tier_cfg, stats.get(tier_cfg.name, {})) for tier_cfg in cfg.tiers)
    return (f"kvstore: serving on {cfg.server.host}:{server.port} admin={server.admin_port}"
            f" socket={server.socket_path} shm={shm} tiers=[{tiers}]"
            f" tls={'on' if server.tls_context is not None else 'off'}")


def describe_tier(tier_cfg: Any, stats: dict[str, Any]) -> str:
    """``name(kind, capacity[, where its data lives][, N blocks recovered])``; never a
    credential (a Redis URL can hold a password: not shown)."""
    parts = [tier_cfg.kind, format_size(tier_cfg.capacity)]
    where = _where(tier_cfg)
    if where:
        parts.append(where)
    recovered = stats.get("recovered_at_start")
    if recovered is not None:
        parts.append(f"{recovered} blocks recovered")
    return f"{tier_cfg.name}({', '.join(parts)})"


def _where(tier_cfg: Any) -> str | None:
    kind = tier_cfg.kind
    if kind == "nvme":
        path = tier_cfg.path
        return ",".join(path) if isinstance(path, list) else path
    if kind == "s3":
        return f"s3://{tier_cfg.bucket}/{tier_cfg.prefix}"
    if kind == "remote":
        return tier_cfg.address
    if kind == "mooncake":
        return f"master {tier_cfg.master}"
    return None


__all__ = ["describe_tier", "start_line"]
