"""The webhook's self-signed certificates: a client that trusts only the CA accepts the server for its hosts."""

from __future__ import annotations

import datetime
import socket
import ssl
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
from cryptography import x509

from stowaway.operator import certificates


def test_the_server_certificate_names_every_host_and_is_signed_by_the_ca_for_the_days_asked() -> None:
    made = certificates.self_signed(["stowaway.stowaway-system.svc", "127.0.0.1"], days=30)
    ca, cert = x509.load_pem_x509_certificate(made.ca_pem), x509.load_pem_x509_certificate(made.cert_pem)
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["stowaway.stowaway-system.svc"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    lifetime = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(days=29) < lifetime <= datetime.timedelta(days=30)


def test_a_service_name_longer_than_a_common_name_may_be_is_certified_for_a_tls_handshake(tmp_path: Path) -> None:
    # <release>-stowaway.<namespace>.svc outgrows the 64 characters of an X.509 common name in long namespaces.
    hosts = certificates.service_hosts("my-release-stowaway", "stowaway-e2e-operator-with-a-long-namespace-0a1b2c")
    assert len(hosts[0]) > 64
    made = certificates.self_signed([*hosts, "127.0.0.1"])
    port, server_side = serve_once(made, tmp_path)
    handshake(port, made.ca_pem, "127.0.0.1")
    assert server_side.result(timeout=5) is None, "the server's side of the handshake failed"
    names = x509.load_pem_x509_certificate(made.cert_pem).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == hosts


def test_each_call_makes_a_new_ca() -> None:
    assert certificates.self_signed(["a"]).ca_pem != certificates.self_signed(["a"]).ca_pem


def serve_once(made: certificates.ServingCertificate, folder: Path) -> tuple[int, Future[OSError | None]]:
    """A TLS server with the certificate that accepts one handshake, as the API server's call to the webhook.

    Returns its port and the server's side of the handshake: None once it completed, the error when the
    client aborted it. Anything else going wrong in the server's thread is raised by the future, not lost.
    """
    (folder / "tls.crt").write_bytes(made.cert_pem)
    (folder / "tls.key").write_bytes(made.key_pem)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "tls.crt", folder / "tls.key")
    listener = socket.create_server(("127.0.0.1", 0))
    server_side: Future[OSError | None] = Future()

    def accept() -> None:
        try:
            with listener, listener.accept()[0] as connection:
                connection.settimeout(5)
                try:
                    with context.wrap_socket(connection, server_side=True):
                        pass
                except (ssl.SSLError, ConnectionError) as aborted:
                    server_side.set_result(aborted)
                else:
                    server_side.set_result(None)
        except BaseException as failure:
            server_side.set_exception(failure)

    threading.Thread(target=accept, daemon=True).start()
    return listener.getsockname()[1], server_side


def handshake(port: int, ca_pem: bytes, host: str) -> None:
    context = ssl.create_default_context(cadata=ca_pem.decode())
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(
        raw, server_hostname=host
    ):
        pass


def test_a_client_trusting_the_ca_bundle_completes_a_tls_handshake_for_a_listed_host(tmp_path: Path) -> None:
    made = certificates.self_signed(["127.0.0.1"])
    port, server_side = serve_once(made, tmp_path)
    handshake(port, made.ca_pem, "127.0.0.1")
    assert server_side.result(timeout=5) is None, "the server's side of the handshake failed"


def test_a_client_refuses_the_certificate_for_a_host_it_does_not_name(tmp_path: Path) -> None:
    made = certificates.self_signed(["stowaway.stowaway-system.svc"])
    port, server_side = serve_once(made, tmp_path)
    with pytest.raises(ssl.SSLCertVerificationError, match=r"IP address mismatch|doesn't match"):
        handshake(port, made.ca_pem, "127.0.0.1")
    assert isinstance(server_side.result(timeout=5), OSError), "the server completed a handshake the client refused"


HOSTS = certificates.service_hosts("stowaway-stowaway", "stowaway-system")
NOW = datetime.datetime.now(datetime.UTC)


def test_the_service_names_put_the_api_servers_tls_server_name_first() -> None:
    assert HOSTS == ["stowaway-stowaway.stowaway-system.svc", "stowaway-stowaway.stowaway-system.svc.cluster.local"]


def test_a_stored_certificate_for_the_service_with_years_left_is_kept() -> None:
    assert certificates.reason_to_replace(certificates.self_signed(HOSTS, days=3650), HOSTS, NOW) is None


def test_a_certificate_within_the_renewal_window_is_replaced_with_its_end_named() -> None:
    made = certificates.self_signed(HOSTS, days=30)
    end = x509.load_pem_x509_certificate(made.cert_pem).not_valid_after_utc
    assert certificates.reason_to_replace(made, HOSTS, NOW) == f"it expires on {end:%Y-%m-%d}"


def test_a_certificate_for_another_service_or_namespace_is_replaced() -> None:
    made = certificates.self_signed(certificates.service_hosts("stowaway-stowaway", "elsewhere"))
    reason = certificates.reason_to_replace(made, HOSTS, NOW)
    assert reason == f"the certificate is not for {', '.join(HOSTS)}"


def test_an_empty_secret_as_the_manifests_create_it_is_filled() -> None:
    assert certificates.reason_to_replace(certificates.ServingCertificate(b"", b"", b""), HOSTS, NOW) == \
        "it is empty or not PEM"


def test_parts_of_two_certificates_are_not_kept() -> None:
    one, other = certificates.self_signed(HOSTS), certificates.self_signed(HOSTS)
    foreign_ca = certificates.ServingCertificate(other.ca_pem, one.cert_pem, one.key_pem)
    assert certificates.reason_to_replace(foreign_ca, HOSTS, NOW) == \
        "the certificate is not signed by the CA stored with it"
    foreign_key = certificates.ServingCertificate(one.ca_pem, one.cert_pem, other.key_pem)
    assert certificates.reason_to_replace(foreign_key, HOSTS, NOW) == "the key does not belong to the certificate"
