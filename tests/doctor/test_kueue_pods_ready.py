"""`rljob doctor`'s check of Kueue's WaitForPodsReady timeouts against how long the run's pods may take to
be ready (cli/doctor/kueue.py), table-driven over Kueue configurations as its ConfigMap holds them."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from doctor.test_checks import LQ_CRDS, needs, pool
from hypothesis import given
from hypothesis import strategies as st
from rljob.cli.doctor.findings import Status
from rljob.cli.doctor.kueue import (
    IMAGE_PULL_SECONDS,
    KUEUE_CONFIG_KEY,
    SLICE_CREATE_SECONDS,
    PodsReady,
    check_pods_ready_timeout,
    expected_ready_seconds,
    parse_duration,
    pods_ready_config,
)

# The example's shapes (v5p-8 trainer and sampler), one ready pool each.
V5P = "tpu-v5p-slice"
READY_POOLS = pool("t", V5P, "2x2x1", 1) + pool("s", V5P, "2x2x1", 1)


def config_map(text: str | None) -> dict[str, Any]:
    return {"metadata": {"name": "kueue-manager-config"}, "data": {KUEUE_CONFIG_KEY: text} if text else {}}


def cfg(version: str = "v1beta2", **wfpr: Any) -> str:
    body: dict[str, Any] = {"apiVersion": f"config.kueue.x-k8s.io/{version}", "kind": "Configuration"}
    if wfpr:
        body["waitForPodsReady"] = wfpr
    return yaml.safe_dump(body)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("30m", 1800.0, id="minutes"),
        pytest.param("1h30m", 5400.0, id="hours-minutes"),
        pytest.param("90s", 90.0, id="seconds"),
        pytest.param("1.5h", 5400.0, id="fraction"),
        pytest.param("500ms", 0.5, id="milliseconds"),
        pytest.param("0", 0.0, id="zero"),
        pytest.param("0s", 0.0, id="zero-seconds"),
        pytest.param("5", None, id="no-unit"),
        pytest.param("5d", None, id="days-unknown"),
        pytest.param("", None, id="empty"),
        pytest.param("m", None, id="unit-only"),
        pytest.param("1h 30m", None, id="space"),
    ],
)
def test_parse_duration(text: str, expected: float | None) -> None:
    assert parse_duration(text) == expected


@given(h=st.integers(0, 100), m=st.integers(0, 59), s=st.integers(0, 59))
def test_parse_duration_sums_its_parts(h: int, m: int, s: int) -> None:
    assert parse_duration(f"{h}h{m}m{s}s") == h * 3600 + m * 60 + s


@given(st.text(max_size=20))
def test_parse_duration_never_raises(text: str) -> None:
    got = parse_duration(text)
    assert got is None or isinstance(got, float)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Kueue v0.19's defaults (apis/config/v1beta2/defaults.go): on, 30 minutes, recovery = timeout.
        pytest.param(cfg(), PodsReady(True, 1800, 1800), id="v1beta2-default"),
        pytest.param(cfg(timeout="60m"), PodsReady(True, 3600, 3600), id="v1beta2-timeout"),
        pytest.param(
            cfg(timeout="60m", recoveryTimeout="10m"), PodsReady(True, 3600, 600), id="v1beta2-recovery"
        ),
        pytest.param(cfg(timeout="60m", recoveryTimeout="0s"), PodsReady(True, 3600, 0), id="no-recovery"),
        pytest.param(cfg("v1beta1"), PodsReady(False), id="v1beta1-off-by-default"),
        pytest.param(cfg("v1beta1", enable=True), PodsReady(True, 300, 300), id="v1beta1-on-5m"),
        pytest.param(cfg(timeout="soon"), "waitForPodsReady.timeout 'soon' is not a duration", id="bad"),
        pytest.param("a: [", "not YAML", id="not-yaml"),
        pytest.param(cfg("v2"), "apiVersion", id="unknown-version"),
    ],
)
def test_pods_ready_config(text: str, expected: PodsReady | str) -> None:
    got = pods_ready_config(text)
    if isinstance(expected, str):
        assert isinstance(got, str) and expected in got
    else:
        assert got == expected


def test_expected_time_adds_node_creation_where_the_pools_lack_ready_nodes() -> None:
    ready, _ = expected_ready_seconds(needs(), READY_POOLS)
    assert ready == IMAGE_PULL_SECONDS
    # The v5p-16 trainer (2 hosts) has no pool: GKE creates its nodes first.
    cold, why = expected_ready_seconds(needs(trainer="v5p-16"), READY_POOLS)
    assert cold == IMAGE_PULL_SECONDS + SLICE_CREATE_SECONDS
    assert why.startswith("trainer:") and "v5p-16" in why
    # Not-ready nodes do not count.
    not_ready = pool("t", V5P, "2x2x1", 1, ready=False) + pool("s", V5P, "2x2x1", 1)
    assert expected_ready_seconds(needs(), not_ready)[0] == IMAGE_PULL_SECONDS + SLICE_CREATE_SECONDS
    # Trainer and sampler of one shape share its pools: one ready node is not enough for both.
    assert expected_ready_seconds(needs(), pool("t", V5P, "2x2x1", 1))[0] > IMAGE_PULL_SECONDS


@pytest.mark.parametrize(
    ("config", "nodes", "expected", "needle"),
    [
        pytest.param(config_map(cfg()), READY_POOLS, Status.OK, "timeout 30m", id="default-covers-warm"),
        pytest.param(config_map(cfg()), [], Status.OK, "~25m", id="default-covers-cold"),
        pytest.param(config_map(cfg(timeout="5m")), READY_POOLS, Status.WARNING, "timeout 5m", id="short"),
        pytest.param(
            config_map(cfg(timeout="60m", recoveryTimeout="3m")),
            READY_POOLS,
            Status.WARNING,
            "recoveryTimeout 3m",
            id="short-recovery",
        ),
        pytest.param(config_map(cfg(timeout="20m")), [], Status.WARNING, "~25m", id="short-for-cold-pools"),
        pytest.param(config_map(cfg("v1beta1")), [], Status.OK, "off", id="off"),
        pytest.param(config_map(cfg(timeout="x")), [], Status.PROBLEM, "not a duration", id="unreadable"),
        pytest.param(config_map(None), [], Status.WARNING, "no key", id="no-key"),
        pytest.param(None, [], Status.WARNING, "v0.19 default: 30m", id="no-configmap"),
        pytest.param(False, [], Status.WARNING, "forbidden", id="forbidden"),
    ],
)
def test_check_pods_ready_timeout(
    config: dict[str, Any] | bool | None, nodes: list[Any], expected: Status, needle: str
) -> None:
    [finding] = check_pods_ready_timeout(LQ_CRDS, config, nodes, needs(queue="lq"))
    assert finding.status == expected, finding
    assert needle in finding.message, finding
    if expected is Status.WARNING and config not in (False,):
        # The fix names the ConfigMap's key and a timeout of twice the expected time (at least 30m).
        assert "waitForPodsReady: {timeout: " in finding.fix and "kueue-manager-config" in finding.fix


def test_fix_asks_for_twice_the_expected_time() -> None:
    [finding] = check_pods_ready_timeout(LQ_CRDS, config_map(cfg(timeout="5m")), [], needs(queue="lq"))
    assert "timeout: 50m" in finding.fix  # 2 x (10m image pull + 15m node creation)


@pytest.mark.parametrize(
    ("crds", "need"),
    [
        pytest.param(LQ_CRDS, needs(), id="no-queue-named"),
        pytest.param({}, needs(queue="lq"), id="no-kueue"),  # the LocalQueue check reports that
        pytest.param(LQ_CRDS, None, id="no-manifest"),
    ],
)
def test_not_checked_without_a_queued_run(crds: dict[str, Any], need: Any) -> None:
    assert check_pods_ready_timeout(crds, config_map(cfg(timeout="1m")), [], need) == []
