"""TLS for the cache server's TCP path, on the stdlib :mod:`ssl` module: the contexts
the server (``server.tls``) and its clients (``Client(tls=...)``, a remote tier's
``tls:``) use, the checks config validation runs on certificate, key and CA files, and
readable messages for TLS failures.

Defaults are the safe ones: TLS 1.2 at least (1.3 where both sides have it, which is
always the case between two kvstore processes), OpenSSL's default AEAD cipher list as
Python configures it, no renegotiation, no compression. A client always verifies the
server's certificate chain (against ``ca``, else the system's trust store) and, unless
``check_hostname`` is turned off, that it names the host it dialled. A server with
``ca`` verifies client certificates: required with ``require_client_cert`` (mutual
TLS), checked when presented otherwise.

Covers TCP only. The same-host path (Unix socket + shared memory) stays plaintext: its
bytes never leave the machine and the socket and arena are private to the server's
user. NIXL/RDMA transfers are not encrypted (out of scope; a TLS client does not pick
NIXL unless asked to, see :class:`kvstore.net.client.Client`).
"""

from __future__ import annotations

import os
import ssl
from typing import Any, Mapping

from kvstore.errors import ConfigError

MIN_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


_ENCRYPTED = "the key is passphrase-protected; give an unencrypted key file (readable by the server's user only)"


def _no_password() -> str:
    # A passphrase-protected key would make OpenSSL prompt on the terminal; refuse instead.
    raise ValueError(_ENCRYPTED)


def _readable(path: str) -> None:
    if not os.path.exists(path):
        raise ValueError("no such file")
    if os.path.isdir(path):
        raise ValueError("is a directory, not a PEM file")
    if not os.access(path, os.R_OK):
        raise ValueError("not readable by this user")


def _reason(exc: ssl.SSLError) -> str:
    return (exc.reason or str(exc)).replace("_", " ").lower()


def check_ca(path: str) -> None:
    """``path`` is a PEM bundle of CA certificates (or a directory of hashed ones, as
    ``openssl rehash`` makes) that OpenSSL loads."""
    if os.path.isdir(path):
        if not os.access(path, os.R_OK | os.X_OK):
            raise ValueError("directory not readable by this user")
        return
    _readable(path)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise ValueError(f"not a PEM CA certificate bundle ({_reason(exc)})") from None


def check_cert(path: str) -> None:
    """``path`` holds at least one PEM certificate (the key is checked with it by
    :func:`check_pair`)."""
    _readable(path)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise ValueError(f"not a PEM certificate ({_reason(exc)})") from None


def validity(path: str, now: float | None = None) -> str | None:
    """Why the first certificate of PEM file ``path`` (the leaf of a chain) cannot serve
    now: expired, or not yet valid (with the date), else ``None``. Read with the ssl
    module's own certificate decoder; ``None`` too where it cannot read the file (the
    other checks report that)."""
    import time

    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None
    try:
        info = decode(path)
        not_before = ssl.cert_time_to_seconds(info["notBefore"])
        not_after = ssl.cert_time_to_seconds(info["notAfter"])
    except (ssl.SSLError, OSError, ValueError, KeyError):
        return None
    now = time.time() if now is None else now
    if now >= not_after:
        return f"expired on {_utc(not_after)} (notAfter); renew it (clients refuse an expired certificate)"
    if now < not_before:
        return f"is not valid until {_utc(not_before)} (notBefore); check this machine's clock, or the certificate"
    return None


def _utc(seconds: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def check_pair(cert: str, key: str) -> None:
    """``key`` is an unencrypted PEM private key that matches the certificate ``cert``."""
    _readable(key)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key, password=_no_password)
    except ssl.SSLError as exc:
        raise ValueError(_key_problem(cert, key, exc)) from None
    except ValueError:
        raise ValueError(_ENCRYPTED) from None


def _key_problem(cert: str, key: str, exc: ssl.SSLError) -> str:
    try:
        with open(key, "rb") as fh:
            text = fh.read(1 << 16)
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if b"ENCRYPTED" in text:
        return _ENCRYPTED
    if exc.reason == "KEY_VALUES_MISMATCH":
        return f"the key does not match the certificate {cert}"
    if b"PRIVATE KEY-----" not in text:
        return "not a PEM private key"
    return f"cannot be loaded with the certificate {cert} ({_reason(exc)})"


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str) -> None:
    try:
        ctx.load_cert_chain(cert, key, password=_no_password)
    except ssl.SSLError as exc:
        raise ValueError(f"{key}: {_key_problem(cert, key, exc)}") from None
    except ValueError:
        raise ValueError(f"{key}: {_ENCRYPTED}") from None


def _load_ca(ctx: ssl.SSLContext, ca: str) -> None:
    if os.path.isdir(ca):
        ctx.load_verify_locations(capath=ca)
    else:
        ctx.load_verify_locations(cafile=ca)


def server_context(cert: str, key: str, ca: str | None = None, require_client_cert: bool = False,
                   min_version: str = "1.2") -> ssl.SSLContext:
    """The server's context: its certificate chain and key; with ``ca``, client
    certificates are verified against it (required with ``require_client_cert``)."""
    if require_client_cert and not ca:
        raise ValueError("require_client_cert needs ca (the CA that signs client certificates)")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = MIN_VERSIONS[min_version]
    ctx.options |= ssl.OP_NO_RENEGOTIATION | ssl.OP_CIPHER_SERVER_PREFERENCE | ssl.OP_NO_COMPRESSION
    ctx.num_tickets = 0   # kvstore clients never resume a session: sending tickets is wasted work
    _load_chain(ctx, cert, key)
    if ca:
        _load_ca(ctx, ca)
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    return ctx


def client_context(ca: str | None = None, cert: str | None = None, key: str | None = None, *,
                   check_hostname: bool = True, min_version: str = "1.2") -> ssl.SSLContext:
    """A client's context: the server's chain is verified against ``ca`` (else the
    system's trust store) and, with ``check_hostname``, its name or IP address;
    ``cert``/``key`` authenticate this client to a server that asks (mutual TLS)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)   # CERT_REQUIRED, check_hostname on
    ctx.minimum_version = MIN_VERSIONS[min_version]
    ctx.options |= ssl.OP_NO_RENEGOTIATION | ssl.OP_NO_COMPRESSION
    if ca:
        _load_ca(ctx, ca)
    else:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if cert:
        if not key:
            raise ValueError("a client certificate needs its key")
        _load_chain(ctx, cert, key)
    ctx.check_hostname = check_hostname
    return ctx


class ClientTls:
    """What a client connection needs for TLS: the context and the name to verify
    (``None``: the host of the address dialled)."""

    __slots__ = ("context", "server_hostname")

    def __init__(self, context: ssl.SSLContext, server_hostname: str | None = None) -> None:
        self.context, self.server_hostname = context, server_hostname

    def wrap(self, sock: Any, host: str) -> ssl.SSLSocket:
        return self.context.wrap_socket(sock, server_hostname=self.server_hostname or host)


def client_tls(tls: Any) -> ClientTls | None:
    """``Client(tls=...)``: ``None`` (plaintext), an :class:`ssl.SSLContext` (used as it
    is, the name checked being the address's host), a
    :class:`kvstore.config.ClientTlsConfig`, or a dict of its fields (``ca``, ``cert``,
    ``key``, ``server_hostname``, ``check_hostname``, ``min_version``)."""
    if tls is None or tls is False:
        return None
    if isinstance(tls, ClientTls):
        return tls
    if isinstance(tls, ssl.SSLContext):
        if tls.verify_mode == ssl.CERT_NONE:
            raise ConfigError("tls: the SSLContext does not verify the server (verify_mode CERT_NONE); "
                             "kvstore does not connect without verifying the server's certificate")
        return ClientTls(tls)
    from kvstore.config import ClientTlsConfig, describe_errors   # pydantic only when settings are given
    from pydantic import ValidationError

    if tls is True:
        tls = {}
    if isinstance(tls, Mapping):
        try:
            tls = ClientTlsConfig.model_validate(dict(tls))
        except ValidationError as exc:
            raise ConfigError("invalid tls settings:\n" + describe_errors(exc, prefix="tls")) from None
    if not isinstance(tls, ClientTlsConfig):
        raise ConfigError(f"tls must be an ssl.SSLContext, a ClientTlsConfig or a dict of its fields, "
                         f"got {type(tls).__name__}")
    return ClientTls(tls.context(), tls.server_hostname)


def describe(exc: BaseException, *, after_handshake: bool = False) -> str:
    """A TLS failure in words, with the likely cause where the error says it.
    ``after_handshake``: the client's side of the handshake had completed, the HELLO
    reply had not come (with TLS 1.3 a server refuses a client certificate then)."""
    reason = getattr(exc, "reason", None) or ""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"the server's certificate failed verification: {exc.verify_message} (check tls.ca, and the " \
               f"name in the certificate against the address or tls.server_hostname)"
    if "CERTIFICATE_REQUIRED" in reason:
        return "the server requires a client certificate (mutual TLS): give tls.cert and tls.key"
    if reason in ("SSLV3_ALERT_BAD_CERTIFICATE", "TLSV1_ALERT_UNKNOWN_CA", "SSLV3_ALERT_CERTIFICATE_UNKNOWN"):
        return "the server refused this client's certificate (not signed by the CA the server trusts)"
    if after_handshake:
        return f"the server closed the connection right after the TLS handshake ({exc}): it requires a client " \
               f"certificate (tls.cert, tls.key) signed by a CA it trusts, or refused this one"
    if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST") \
            or isinstance(exc, (ssl.SSLEOFError, ConnectionResetError, BrokenPipeError)):
        return f"the server did not answer in TLS ({exc}); is server.tls set on that server?"
    if "PROTOCOL_VERSION" in reason or "UNSUPPORTED_PROTOCOL" in reason:
        return f"no TLS version both sides accept ({exc}); kvstore needs TLS 1.2 or later"
    return str(exc)


__all__ = ["ClientTls", "MIN_VERSIONS", "check_ca", "check_cert", "check_pair", "client_context", "client_tls",
           "describe", "server_context", "validity"]
