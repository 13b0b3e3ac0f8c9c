"""TLS settings: the server's listener (``server.tls``) and a client's (a remote tier's ``tls:``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from kvstore.config.base import _Frozen

TlsVersion = Literal["1.2", "1.3"]


def _check_file(kind: str) -> Any:
    """A field validator: the file (or CA directory) exists and OpenSSL loads it."""
    from kvstore.net import tls as _tls

    check = {"ca": _tls.check_ca, "cert": _tls.check_cert}[kind]

    def validate(value: str | None) -> str | None:
        if value is not None:
            check(value)
        return value
    return validate


def _check_key(value: str | None, info: Any) -> str | None:
    """``key`` loads with ``cert`` (validated first: fields validate in order)."""
    from kvstore.net import tls as _tls

    cert = info.data.get("cert")   # absent when invalid (reported there); None: the pair check reports it
    if value is not None and cert is not None:
        _tls.check_pair(cert, value)
    return value


class ServerTlsConfig(_Frozen):
    """``server.tls``: the TCP listener (and the admin port) speak TLS with this
    certificate and key. ``ca`` verifies client certificates: required with
    ``require_client_cert`` (mutual TLS), checked when presented otherwise. The
    same-host Unix socket and shared memory stay plaintext (see ``docs/server.md``)."""

    cert: str = Field(min_length=1)           # PEM certificate chain, leaf first
    key: str = Field(min_length=1)            # its unencrypted PEM private key
    ca: str | None = None                     # PEM CA bundle (or hashed directory) for client certificates
    require_client_cert: bool = False         # mutual TLS: refuse clients without a certificate from ca
    min_version: TlsVersion = "1.2"

    _files = field_validator("cert")(_check_file("cert"))
    _ca = field_validator("ca")(_check_file("ca"))
    _key = field_validator("key")(_check_key)

    @model_validator(mode="after")
    def _mtls_needs_ca(self) -> "ServerTlsConfig":
        if self.require_client_cert and not self.ca:
            raise ValueError("require_client_cert: true needs ca (the CA that signs client certificates)")
        return self

    def context(self) -> Any:
        """A fresh :class:`ssl.SSLContext` (files read again: a restart picks up new ones)."""
        from kvstore.net import tls as _tls

        return _tls.server_context(self.cert, self.key, self.ca, self.require_client_cert, self.min_version)


class ClientTlsConfig(_Frozen):
    """TLS to a kvstore server (a remote tier's ``tls:``, ``Client(tls=...)``): the
    server's chain is verified against ``ca`` (none: the system's trust store) and,
    with ``check_hostname``, must name ``server_hostname`` (default: the host of the
    address); ``cert`` and ``key`` authenticate this client (mutual TLS)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_hostname: str | None = Field(None, min_length=1)
    check_hostname: bool = True               # false: the chain is still verified, the name is not
    min_version: TlsVersion = "1.2"

    _files = field_validator("cert")(_check_file("cert"))
    _ca = field_validator("ca")(_check_file("ca"))
    _key = field_validator("key")(_check_key)

    @model_validator(mode="after")
    def _pair(self) -> "ClientTlsConfig":
        if (self.cert is None) != (self.key is None):
            raise ValueError("give both cert and key (a client certificate), or neither")
        return self

    def context(self) -> Any:
        """A fresh :class:`ssl.SSLContext` for these settings."""
        from kvstore.net import tls as _tls

        return _tls.client_context(self.ca, self.cert, self.key, check_hostname=self.check_hostname,
                                   min_version=self.min_version)


def _tls_flag(value: Any) -> Any:
    """``tls: true`` is TLS verified against the system's trust store; ``false``: none."""
    if value is True:
        return {}
    if value is False:
        return None
    return value


__all__ = ["ClientTlsConfig", "ServerTlsConfig", "TlsVersion"]
