"""The admin port's bounds (``server.admin:``): what one request, one address and the
port's own threads may take, so no admin request stalls the data plane or locks out
``/healthz`` (see ``docs/server.md``, Admin endpoints)."""

from __future__ import annotations

from pydantic import Field

from kvstore.config.base import Size, _Frozen


class AdminConfig(_Frozen):
    """``server.admin``: bounds of the admin port (``server.admin_port``)."""

    max_body_bytes: Size = Field(4 << 20, gt=0)          # a request body (413 past it, unread)
    lookup_max_tokens: int = Field(262_144, ge=1)        # token ids (or keys) of one POST /v1/lookup (413 past it)
    max_connections_per_ip: int = Field(16, ge=1)        # open admin connections from one address
    threads: int = Field(2, ge=1, le=64)                 # the admin port's own threads (/stats, /clear, lookups)
    queue: int = Field(8, ge=0)                          # requests waiting for them (503 past it)


__all__ = ["AdminConfig"]
