"""The operator's settings: what the chart sets is read, and a mistake stops it with the variable named."""

from __future__ import annotations

from pathlib import Path

import pytest

from stowaway.operator import settings

CHART_ENV = {
    "STOWAWAY_OPERATOR_NAMESPACE": "stowaway-system",
    "STOWAWAY_SIDECAR_IMAGE": "stowaway/stowaway:0.1.0",
    "STOWAWAY_WEBHOOK_CERT_DIR": "/etc/stowaway/webhook-tls",
}


def test_the_charts_environment_gives_the_defaults_for_every_port() -> None:
    config = settings.from_environ(CHART_ENV)
    assert config == settings.OperatorSettings(
        namespace="stowaway-system", sidecar_image="stowaway/stowaway:0.1.0", webhook_port=8443,
        cert_dir=Path("/etc/stowaway/webhook-tls"), health_port=8080, metrics_port=9464, dev_host=None,
        managed_tls=None,
    )


def test_ports_are_read_from_the_environment() -> None:
    env = {**CHART_ENV, "STOWAWAY_WEBHOOK_PORT": "9443", "STOWAWAY_HEALTH_PORT": "8081",
           "STOWAWAY_METRICS_PORT": "9090"}
    config = settings.from_environ(env)
    assert (config.webhook_port, config.health_port, config.metrics_port) == (9443, 8081, 9090)


@pytest.mark.parametrize("value", ["", "0", "65536", "http", "-1", "80.5"])
@pytest.mark.parametrize("name", ["STOWAWAY_WEBHOOK_PORT", "STOWAWAY_HEALTH_PORT", "STOWAWAY_METRICS_PORT"])
def test_a_bad_port_is_refused_with_its_variable_and_value(name: str, value: str) -> None:
    with pytest.raises(settings.SettingsError, match=f"{name}={value!r} is not a TCP port number"):
        settings.from_environ({**CHART_ENV, name: value})


@pytest.mark.parametrize("name", ["STOWAWAY_OPERATOR_NAMESPACE", "STOWAWAY_SIDECAR_IMAGE"])
def test_a_missing_required_setting_is_named_and_points_at_the_chart(name: str) -> None:
    env = {key: value for key, value in CHART_ENV.items() if key != name}
    with pytest.raises(settings.SettingsError, match=f"{name} is not set; the Helm chart sets it"):
        settings.from_environ(env)


def test_without_a_certificate_directory_or_a_dev_host_the_error_says_which_to_set() -> None:
    env = {key: value for key, value in CHART_ENV.items() if key != "STOWAWAY_WEBHOOK_CERT_DIR"}
    with pytest.raises(settings.SettingsError, match=r"CERT_DIR is not set.*WEBHOOK_TLS_SECRET.*WEBHOOK_DEV_HOST"):
        settings.from_environ(env)


def test_a_dev_host_alone_is_enough_for_local_development() -> None:
    env = {key: value for key, value in CHART_ENV.items() if key != "STOWAWAY_WEBHOOK_CERT_DIR"}
    config = settings.from_environ({**env, "STOWAWAY_WEBHOOK_DEV_HOST": "host.docker.internal"})
    assert (config.cert_dir, config.dev_host) == (None, "host.docker.internal")


OPERATOR_TLS_ENV = {
    **{key: value for key, value in CHART_ENV.items() if key != "STOWAWAY_WEBHOOK_CERT_DIR"},
    "STOWAWAY_WEBHOOK_TLS_SECRET": "stowaway-stowaway-webhook-tls",
    "STOWAWAY_WEBHOOK_SERVICE": "stowaway-stowaway",
    "STOWAWAY_WEBHOOK_CONFIGURATION": "stowaway-stowaway",
}


def test_the_operators_own_tls_mode_names_its_secret_service_and_webhook_configuration() -> None:
    config = settings.from_environ(OPERATOR_TLS_ENV)
    assert config.cert_dir is None
    assert config.managed_tls == settings.ManagedTLS(
        secret="stowaway-stowaway-webhook-tls", service="stowaway-stowaway", configuration="stowaway-stowaway",
    )


@pytest.mark.parametrize("name", ["STOWAWAY_WEBHOOK_SERVICE", "STOWAWAY_WEBHOOK_CONFIGURATION"])
def test_the_operators_own_tls_mode_without_one_of_its_names_is_refused_with_it_named(name: str) -> None:
    env = {key: value for key, value in OPERATOR_TLS_ENV.items() if key != name}
    with pytest.raises(settings.SettingsError, match=f"{name} is not set"):
        settings.from_environ(env)


def test_a_mounted_certificate_and_the_operators_own_are_not_both_accepted() -> None:
    with pytest.raises(settings.SettingsError, match="CERT_DIR and STOWAWAY_WEBHOOK_TLS_SECRET are both set"):
        settings.from_environ({**OPERATOR_TLS_ENV, "STOWAWAY_WEBHOOK_CERT_DIR": "/etc/stowaway/webhook-tls"})
