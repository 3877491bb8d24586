"""The real-kubelet plugin benchmark's parsing: per-call times from the kubelet's DRA log lines and
histogram sums from its /metrics."""

from __future__ import annotations

import pytest

from bench.plugin_real import histogram_sums, kubelet_dra_calls, ratio_ci95

A = "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9"
B = "11111111-2222-4333-8444-555555555555"
POD = "99999999-8888-4777-8666-555555555555"
ENDPOINT = 'driverName="gpu.example.com" endpoint="/tmp/n/kubelet/plugins/gpu.example.com/dra.sock"'


def _call(time: str, claim: str) -> str:
    return (
        f'I1201 {time}    4242 dra_plugin.go:144] "Calling NodePrepareResources rpc" pod="default/p" '
        f'podUID="{POD}" {ENDPOINT} request="claims:{{namespace:\\"default\\" uid:\\"{claim}\\" name:\\"p-gpu\\"}}"'
    )


def _done(time: str, claim: str) -> str:
    return (
        f'I1201 {time}    4243 dra_plugin.go:163] "Done calling NodePrepareResources rpc" pod="default/p" '
        f'podUID="{POD}" {ENDPOINT} response="claims:{{key:\\"{claim}\\" value:{{devices:{{pool_name:\\"n\\"}}}}}}" err=null'
    )


def test_concurrent_calls_pair_by_claim_uid_not_by_order():
    text = "\n".join(
        [
            "I1201 17:00:00.000000    4242 kubelet.go:1] unrelated line",
            _call("17:00:01.000100", A),
            _call("17:00:01.000200", B),
            _done("17:00:01.004200", B),  # B finishes first
            _done("17:00:01.006100", A),
            # The unprepare start line says "NodeUnprepareResource" (no s) in the kubelet's source.
            f'I1201 17:00:02.000000 4242 dra_plugin.go:173] "Calling NodeUnprepareResource rpc" '
            f'request="claims:{{namespace:\\"default\\" uid:\\"{A}\\" name:\\"p-gpu\\"}}" {ENDPOINT}',
            f'I1201 17:00:02.003500 4242 dra_plugin.go:194] "Done calling NodeUnprepareResources rpc" '
            f'{ENDPOINT} response="claims:{{key:\\"{A}\\" value:{{}}}}" err=null',
        ]
    )
    calls = kubelet_dra_calls(text)
    got = {(c.method, c.claim_uid): c.seconds for c in calls}
    assert got == {
        ("NodePrepareResources", B): pytest.approx(0.004),
        ("NodePrepareResources", A): pytest.approx(0.006),
        ("NodeUnprepareResources", A): pytest.approx(0.0035),
    }


def test_a_call_over_midnight_and_an_unfinished_call():
    text = "\n".join([_call("23:59:59.999000", A), _done("00:00:00.001000", A), _call("00:00:01.000000", B)])
    (call,) = kubelet_dra_calls(text)  # B never ended: dropped
    assert call.seconds == pytest.approx(0.002)


def test_an_answer_without_a_start_is_an_error():
    with pytest.raises(ValueError, match="ended without a start"):
        kubelet_dra_calls(_done("17:00:01.000000", A))


def test_histogram_sums_select_by_labels():
    text = "\n".join(
        [
            "# HELP dra_grpc_operations_duration_seconds [ALPHA] Duration in seconds of the DRA gRPC operations",
            'dra_grpc_operations_duration_seconds_bucket{driver_name="gpu.example.com",grpc_status_code="OK",'
            'method_name="/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",le="0.1"} 3',
            'dra_grpc_operations_duration_seconds_sum{driver_name="gpu.example.com",grpc_status_code="OK",'
            'method_name="/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"} 0.015',
            'dra_grpc_operations_duration_seconds_count{driver_name="gpu.example.com",grpc_status_code="OK",'
            'method_name="/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"} 3',
            'dra_grpc_operations_duration_seconds_sum{driver_name="gpu.example.com",grpc_status_code="Unknown",'
            'method_name="/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"} 0.005',
            'dra_grpc_operations_duration_seconds_count{driver_name="gpu.example.com",grpc_status_code="Unknown",'
            'method_name="/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"} 1',
            'dra_grpc_operations_duration_seconds_count{driver_name="other",grpc_status_code="OK",'
            'method_name="/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"} 7',
        ]
    )
    method = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
    assert histogram_sums(
        text, "dra_grpc_operations_duration_seconds", driver_name="gpu.example.com", method_name=method
    ) == (
        pytest.approx(0.02),
        4.0,
    )
    assert histogram_sums(text, "dra_grpc_operations_duration_seconds", driver_name="none") == (0.0, 0.0)


def test_ratio_interval_brackets_the_ratio_of_means_and_tells_noise_from_a_difference():
    base = [0.007 + 0.002 * ((i * 37) % 11) / 10 for i in range(60)]  # 7-9 ms, spread
    slower = [x * 1.2 for x in base]
    low, high = ratio_ci95(slower, base)
    assert low < 0.2 < high and low > 0.1  # 20 % slower: inside, and told apart from no change
    low, high = ratio_ci95(list(reversed(base)), base)
    assert low < 0 < high  # the same calls in another order: no difference
    assert ratio_ci95(slower, base) == ratio_ci95(slower, base)  # seeded: the same calls, the same interval
