"""Self-signed webhook certificates, made with ``cryptography``, and whether a stored one can be kept.

kopf's own self-signed certificates need ``oscrypto``, which fails against
OpenSSL 3 (Debian 12), so the operator never uses them. This module serves
the operator's own TLS mode (``webhook.tls.mode=operator``, what ``deploy/``
uses: a certificate made once, stored in a Secret and kept across restarts),
local development (``--dev`` self-registration) and tests. The chart's other
modes provide the certificate themselves (Helm, cert-manager, or the user).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

# Long enough that the operator, which only looks at its certificate when it starts, never serves an expired one
# in practice; renewed at a start less than RENEW_BEFORE from the end.
VALIDITY_DAYS = 3650
RENEW_BEFORE = datetime.timedelta(days=90)


@dataclass(frozen=True)
class ServingCertificate:
    """PEM-encoded CA certificate (the webhook's caBundle), server certificate and its key."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes


def service_hosts(service: str, namespace: str) -> list[str]:
    """The names the API server may call a Service by: ``<service>.<namespace>.svc`` first (its TLS server name)."""
    return [f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]


def reason_to_replace(found: ServingCertificate, hosts: list[str], now: datetime.datetime) -> str | None:
    """Why a stored certificate cannot be served for ``hosts`` until well after ``now``; None if it can.

    Anything unreadable counts as a reason rather than an error: the operator
    then makes a new one, which is always safe because it also replaces the caBundle.
    """
    try:
        ca = x509.load_pem_x509_certificate(found.ca_pem)
        cert = x509.load_pem_x509_certificate(found.cert_pem)
        key = serialization.load_pem_private_key(found.key_pem, password=None)
    except ValueError:
        return "it is empty or not PEM"
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return "the certificate is not signed by the CA stored with it"
    if cert.public_key() != key.public_key():
        return "the key does not belong to the certificate"
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "the certificate names no host"
    named = {*names.get_values_for_type(x509.DNSName), *map(str, names.get_values_for_type(x509.IPAddress))}
    missing = [host for host in hosts if host not in named]
    if missing:
        return f"the certificate is not for {', '.join(missing)}"
    ends = min(ca.not_valid_after_utc, cert.not_valid_after_utc)
    if ends - now < RENEW_BEFORE:
        return f"it expires on {ends:%Y-%m-%d}"
    return None


def self_signed(hosts: list[str], days: int = 365) -> ServingCertificate:
    """A throw-away CA and a server certificate for ``hosts`` (DNS names or IP addresses) signed by it."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stowaway-webhook-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        # A common name holds at most 64 characters, and <release>-stowaway.<namespace>.svc can be longer;
        # clients (the API server among them) check the DNS names in the SAN extension, not the common name.
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stowaway-webhook")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return ServingCertificate(
        ca_pem=ca.public_bytes(serialization.Encoding.PEM),
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)
