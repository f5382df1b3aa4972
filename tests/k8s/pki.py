"""Throw-away PKI for the test control plane.

A real API server refuses to run without TLS, client authentication and
service-account signing keys, and we want the suite to exercise exactly the
code paths a production cluster uses (x509 client certificates mapped to RBAC
users and groups, webhooks calling back over TLS). So we mint a fresh CA per
test session with the ``cryptography`` package instead of relying on
``--cert-dir`` self-signed certificates, which clients could not verify.

ECDSA P-256 keys are used throughout: they are generated in microseconds, where
RSA-2048 takes tens of milliseconds each.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = dt.timedelta(days=2)


@dataclass(frozen=True)
class KeyPair:
    """PEM files of one certificate and its private key."""

    cert: Path
    key: Path


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


class CertificateAuthority:
    """A self-signed CA that issues the serving and client certificates."""

    def __init__(self, directory: Path, common_name: str = "stowaway-test-ca", stem: str = "ca") -> None:
        self.directory = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = _name(common_name)
        now = dt.datetime.now(dt.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(self._name)
            .issuer_name(self._name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        self.pair = KeyPair(directory / f"{stem}.crt", directory / f"{stem}.key")
        self.pair.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        _write_key(self._key, self.pair.key)

    @property
    def cert_path(self) -> Path:
        """PEM of the CA certificate, the trust anchor for every component."""
        return self.pair.cert

    def issue(
        self,
        name: str,
        common_name: str,
        *,
        organizations: tuple[str, ...] = (),
        dns_names: tuple[str, ...] = (),
        ip_addresses: tuple[str, ...] = (),
        server: bool = False,
        client: bool = False,
    ) -> KeyPair:
        """Issue a leaf certificate written to ``<name>.crt`` / ``<name>.key``.

        For client certificates the API server maps CN to the user name and
        each O to a group, which is how ``O=system:masters`` grants admin.
        """
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        usages = []
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name, organizations))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
        )
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        pair = KeyPair(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, pair.key)
        return pair


def service_account_keys(directory: Path) -> KeyPair:
    """Key pair the API server signs (and verifies) service-account tokens with.

    ``cert`` holds the PEM public key, not a certificate: that is what
    ``--service-account-key-file`` expects.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    pair = KeyPair(directory / "sa.pub", directory / "sa.key")
    pair.cert.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    _write_key(key, pair.key)
    return pair
