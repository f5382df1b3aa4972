"""The operator's series: bounded labels, all present from the start, and base units."""

from __future__ import annotations

from stowaway.operator import metrics


def exposed(exported: metrics.OperatorMetrics) -> str:
    return exported.exposition()[0].decode()


def test_every_result_is_exported_at_zero_before_the_first_admission() -> None:
    text = exposed(metrics.OperatorMetrics())
    for result in metrics.RESULTS:
        assert f'stowaway_operator_injections_total{{result="{result}"}} 0.0' in text
    assert "stowaway_operator_policy_reconcile_errors_total 0.0" in text
    assert "stowaway_operator_webhook_duration_seconds_count 0.0" in text


def test_an_admission_counts_its_result_and_its_duration_in_seconds() -> None:
    exported = metrics.OperatorMetrics()
    exported.admitted("injected", 0.003)
    text = exposed(exported)
    assert 'stowaway_operator_injections_total{result="injected"} 1.0' in text
    assert 'stowaway_operator_webhook_duration_seconds_bucket{le="0.0025"} 0.0' in text
    assert 'stowaway_operator_webhook_duration_seconds_bucket{le="0.005"} 1.0' in text


def test_an_unknown_result_is_counted_as_error_and_adds_no_series() -> None:
    exported = metrics.OperatorMetrics()
    exported.admitted("surprise", 0.1)
    text = exposed(exported)
    assert 'result="surprise"' not in text
    assert 'stowaway_operator_injections_total{result="error"} 1.0' in text


def test_two_operators_in_one_process_do_not_share_numbers() -> None:
    one, other = metrics.OperatorMetrics(), metrics.OperatorMetrics()
    one.admitted("denied", 0.01)
    assert 'stowaway_operator_injections_total{result="denied"} 0.0' in exposed(other)
