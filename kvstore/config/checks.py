"""The checks ``kvstore serve`` makes before it builds anything, short of binding ports:
:func:`preflight`. ``kvstore config validate`` runs the same function, so the two cannot
drift. Each failure is a :class:`ConfigError` naming the field."""

from __future__ import annotations

import importlib.util
import ipaddress
import os

from kvstore._extras import install_hint
from kvstore.config.store import StoreConfig
from kvstore.config.tiers import DramTierConfig, NvmeTierConfig, RedisTierConfig
from kvstore.errors import ConfigError

AIOHTTP_MISSING = (f"server.admin_port: the admin port needs aiohttp ({install_hint('server')}); "
                   "set admin_port: null to serve without it")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False      # a name other than localhost may resolve anywhere


def preflight(config: StoreConfig) -> None:
    """Refuse, naming the field, a config ``kvstore serve`` would fail to start with:
    a non-loopback host without a token, transports tenants cannot have, tier directories
    that cannot be created or written, a Redis ``password_env`` that is not set, a
    missing aiohttp for the admin port, a server certificate expired or not yet valid.
    Creates nothing."""
    _server(config)
    for tier in config.tiers:
        if isinstance(tier, NvmeTierConfig):
            for path in tier.paths:
                _creatable_dir(f"tiers.{tier.name}.path", path)
        elif isinstance(tier, DramTierConfig) and tier.shm_path:
            _creatable_dir(f"tiers.{tier.name}.shm_path", os.path.dirname(os.path.abspath(tier.shm_path)))
        elif isinstance(tier, RedisTierConfig):
            tier.resolved_password()


def _server(config: StoreConfig) -> None:
    cfg = config.server
    if cfg.tenants and cfg.transport in ("shm", "nixl"):
        raise ConfigError(f"server.transport: {cfg.transport!r} is not offered with server.tenants (the "
                          f"{'shared arena' if cfg.transport == 'shm' else 'NIXL metadata of the arena'} "
                          "would let every tenant read and write every other's blocks); use 'auto' or 'tcp'")
    if cfg.token is None and not cfg.tenants and not cfg.allow_unauthenticated and not is_loopback(cfg.host):
        raise ConfigError(f"server.host {cfg.host!r} serves beyond this machine, and no server.token is set "
                          "(nor server.tenants): anyone who reaches the port could read and write the cache; "
                          "set a token, or set server.allow_unauthenticated: true to serve without one")
    if cfg.transport == "shm" and config.tiers[0].kind != "dram":
        raise ConfigError("server.transport: 'shm' needs a first tier of kind dram")
    if cfg.admin_port is not None and importlib.util.find_spec("aiohttp") is None:
        raise ConfigError(AIOHTTP_MISSING)
    if cfg.tls is not None:
        from kvstore.net.tls import validity

        problem = validity(cfg.tls.cert)
        if problem is not None:
            raise ConfigError(f"server.tls.cert: {cfg.tls.cert} {problem}")


def _creatable_dir(field: str, path: str) -> None:
    """``path`` is a writable directory, or the nearest part of it that exists is one
    (so it can be created)."""
    real = os.path.realpath(path)
    if real == os.path.sep:
        raise ConfigError(f"{field}: {path!r} is the root directory; give the tier a directory of its own")
    probe = real
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        what = "exists and is not a directory" if probe == real else f"cannot be created: {probe} is not a directory"
        raise ConfigError(f"{field}: {path!r} {what}")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == real else f"cannot be created: {probe} is not writable"
        raise ConfigError(f"{field}: {path!r} {what} by this user")


__all__ = ["AIOHTTP_MISSING", "is_loopback", "preflight"]
