"""Throwaway PKI for the TLS tests and benchmarks: a CA, a server certificate for
``localhost``/127.0.0.1/::1, and client certificates, written as PEM files (keys
mode 0600). Needs the ``cryptography`` package (the test extra)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    ca: str             # the CA certificate (PEM)
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    dir: Path

    def server_tls(self, **extra: object) -> dict:
        return {"cert": self.server_cert, "key": self.server_key, **extra}

    def client_tls(self, *, cert: bool = False, **extra: object) -> dict:
        out: dict = {"ca": self.ca, **extra}
        if cert:
            out.update(cert=self.client_cert, key=self.client_key)
        return out


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key, password: bytes | None = None) -> str:
    from cryptography.hazmat.primitives import serialization

    enc = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc))
    return str(path)


def _write_cert(path: Path, cert) -> str:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(cn: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    key = _key()
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca_key, ca_cert, cn: str, *, server: bool, hosts: tuple[str, ...] = (),
          valid: tuple[dt.datetime, dt.datetime] | None = None):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = _key()
    now = dt.datetime.now(dt.timezone.utc)
    not_before, not_after = valid or (now - dt.timedelta(minutes=5), now + dt.timedelta(days=1))
    sans = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(not_before).not_valid_after(not_after)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                     else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def make_pki(directory: str | os.PathLike, *, name: str = "kvstore-test",
             server_valid: tuple[dt.datetime, dt.datetime] | None = None) -> Pki:
    """A CA and a server and a client certificate it signed, under ``directory``;
    ``server_valid``: the server certificate's (notBefore, notAfter), default from five
    minutes ago to a day ahead."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca(f"{name} CA")
    skey, scert = _leaf(ca_key, ca_cert, "localhost", server=True, hosts=("localhost", "127.0.0.1", "::1"),
                        valid=server_valid)
    ckey, ccert = _leaf(ca_key, ca_cert, f"{name} client", server=False)
    return Pki(ca=_write_cert(d / f"{name}-ca.pem", ca_cert),
               server_cert=_write_cert(d / f"{name}-server.pem", scert),
               server_key=_write_key(d / f"{name}-server.key", skey),
               client_cert=_write_cert(d / f"{name}-client.pem", ccert),
               client_key=_write_key(d / f"{name}-client.key", ckey), dir=d)


def encrypted_key(directory: str | os.PathLike) -> str:
    """A passphrase-protected private key file (for the config error tests)."""
    return _write_key(Path(directory) / "encrypted.key", _key(), password=b"secret")


__all__ = ["Pki", "encrypted_key", "make_pki"]
