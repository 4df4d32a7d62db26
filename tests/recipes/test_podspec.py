"""The pod-spec building blocks (rljob.recipes.podspec): the security contexts, the ServiceAccount token, a
TPU container's resources, and that the rendered pods carry them (the whole `restricted` check is
tests/recipes/test_render.py's)."""

from __future__ import annotations

import pytest
from fixtures.recipes import manifest, objects
from rljob.recipes import naming, podspec


def test_the_security_contexts() -> None:
    assert podspec.pod_security_context() == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert podspec.container_security_context() == {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert podspec.container_security_context() is not podspec.container_security_context()  # no shared dict


@pytest.mark.parametrize(("role", "mounts"), [(naming.TRAINER, True), (naming.SAMPLER, False), ("x", False)])
def test_only_the_trainer_gets_an_api_token(role: str, mounts: bool) -> None:
    assert podspec.mounts_api_token(role) is mounts


def test_resources_request_the_floor_the_disk_and_the_chips_and_limit_only_the_chips() -> None:
    got = podspec.resources(4, "google.com/tpu", "10Gi")
    assert got == {
        "requests": {"cpu": "1", "memory": "4Gi", "ephemeral-storage": "10Gi", "google.com/tpu": 4},
        "limits": {"google.com/tpu": 4},
    }
    assert podspec.REQUESTS == {"cpu": "1", "memory": "4Gi"}  # resources() did not change the floor


def test_the_rendered_pods_carry_them() -> None:
    js = objects(manifest({}))[-1]
    for rj in js["spec"]["replicatedJobs"]:
        pod = rj["template"]["spec"]["template"]["spec"]
        assert pod["securityContext"] == podspec.pod_security_context()
        assert pod["automountServiceAccountToken"] is podspec.mounts_api_token(rj["name"])
        for c in pod["containers"]:
            assert c["securityContext"] == podspec.container_security_context()
            assert c["terminationMessagePolicy"] == podspec.TERMINATION_MESSAGE_POLICY
            assert c["resources"]["limits"] == {
                "google.com/tpu": c["resources"]["requests"]["google.com/tpu"]
            }
            assert {k: c["resources"]["requests"][k] for k in podspec.REQUESTS} == podspec.REQUESTS
