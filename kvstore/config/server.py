"""The cache server's settings (``server:``): listener, limits, TLS and tenants."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from kvstore.config.admin import AdminConfig
from kvstore.config.base import SECRET, Size, _Frozen, _no_empty_token
from kvstore.config.tls import ServerTlsConfig


def _no_empty_tenant_token(data: Any) -> Any:
    return _no_empty_token(data, "every tenant needs a token of its own")


MIN_SALT_CHARS = 16   # a tenant's salt (server.tenants.<i>.salt) is a secret


class TenantConfig(_Frozen):
    """One tenant of the cache server (``server.tenants``, see ``docs/server.md``,
    Tenants): clients that authenticate with ``token`` work in the key space of
    ``salt`` and store at most ``quota[tier]`` bytes in each tier named there."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    token: str = Field(min_length=1, json_schema_extra=SECRET)
    salt: str = Field(min_length=1, json_schema_extra=SECRET)
    quota: dict[str, Size] = {}     # tier name -> bytes (0: none in that tier); tiers not named: no cap

    _token_given = model_validator(mode="before")(_no_empty_tenant_token)

    @field_validator("salt")
    @classmethod
    def _some_salt(cls, salt: str) -> str:
        if not salt.strip():
            raise ValueError("salt is blank; give each tenant a salt of its own")
        # KV events carry keys mapped under the salt alone: whoever knows (or guesses) it
        # can test which of the tenant's prompts are cached. A secret, like the token.
        if len(salt) < MIN_SALT_CHARS:
            raise ValueError(f"salt has {len(salt)} characters, needs at least {MIN_SALT_CHARS}: it is a "
                             "secret, like the token (KV events carry keys mapped under it); e.g. "
                             "`python -c 'import secrets; print(secrets.token_hex(16))'`")
        return salt


class ServerConfig(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(7480, ge=0, le=65535)
    admin_port: int | None = Field(7481, ge=0, le=65535)
    admin: AdminConfig = AdminConfig()       # the admin port's bounds (per request, per address, its threads)
    socket_path: str | None = None
    token: str | None = Field(None, json_schema_extra=SECRET)
    allow_unauthenticated: bool = False      # serve beyond loopback without a token (refused otherwise)

    _token_given = model_validator(mode="before")(_no_empty_token)
    # Each tenant's token opens its own key space (salt) with per-tier quotas; with
    # ``token`` as well, that token is the tenant named "default" (no quota).
    tenants: list[TenantConfig] = []
    transport: Literal["auto", "tcp", "shm", "nixl"] = "auto"
    max_frame_bytes: Size = Field(256 << 20, gt=0)
    max_batch: int = Field(4096, ge=1, le=1 << 20)   # records per request (bounded: size sums stay exact)
    max_inflight_bytes: Size = Field(1 << 30, gt=0)
    max_inflight_bytes_total: Size = Field(4 << 30, gt=0)   # every connection's buffers together
    idle_timeout_s: float = Field(300.0, gt=0)
    handshake_timeout_s: float = Field(5.0, gt=0)  # a connection must authenticate (HELLO) within this
    read_timeout_s: float = Field(30.0, gt=0)      # a frame's body or payload may stall this long at most
    # A frame's body and payload must arrive at this rate at least (bytes per second of
    # waiting for them, over the whole frame) once its first min_body_rate_grace_s have
    # passed; a slower connection is closed (0: no rate, read_timeout_s alone).
    min_body_rate_bytes_s: Size = Field(1 << 20, ge=0)
    min_body_rate_grace_s: float = Field(2.0, gt=0)
    max_connections: int = Field(1024, ge=1)       # open client connections; more are closed at accept
    # of max_connections, at most this many not yet authenticated (the oldest is closed
    # for a new one): the rest stay for authenticated sessions
    max_unauthenticated_connections: int = Field(128, ge=1)
    max_connections_per_ip: int = Field(512, ge=1)  # open TCP connections from one address
    shm_lease_s: float = Field(30.0, gt=0)       # a same-host read lease ends after this at most
    shutdown_grace_s: float = Field(10.0, ge=0)  # requests in flight get this long at shutdown
    send_threads: int = Field(4, ge=0)           # threads sending large TCP GET replies (0: the event loop)
    tls: ServerTlsConfig | None = None           # TLS on the TCP listener and the admin port

    @model_validator(mode="after")
    def _distinct_tenants(self) -> "ServerConfig":
        """Names, tokens and salts each unique (one token, one key space); the
        ``token`` is the tenant "default", so that name and its token are taken."""
        seen: dict[str, dict[str, str]] = {"name": {}, "token": {}, "salt": {}}
        if self.token is not None and self.tenants:
            seen["name"]["default"] = "the name of server.token's tenant"
            seen["token"][self.token] = "server.token"
        for i, tenant in enumerate(self.tenants):
            for field_name in ("name", "token", "salt"):
                value = getattr(tenant, field_name)
                other = seen[field_name].get(value)
                if other is not None:
                    shown = f"this {field_name}" if field_name in ("token", "salt") else repr(value)
                    raise ValueError(f"tenants.{i}.{field_name}: {shown} is already {other}; each tenant "
                                     f"needs its own {field_name}")
                seen[field_name][value] = f"the {field_name} of tenants.{i}"
        return self


__all__ = ["MIN_SALT_CHARS", "ServerConfig", "TenantConfig"]
