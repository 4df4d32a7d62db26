"""The renderer at its edges: a broken render is caught with every violation named, no pod is on the host
network (a multislice trainer included), and `rljob render` never folds a long value."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from fixtures.recipes import manifest, objects, resolve
from rljob.recipes import placement, render

TESTED_MODULES = ("rljob.recipes.placement",)


def _pod(js: dict[str, Any], role: str) -> dict[str, Any]:
    rj = next(rj for rj in js["spec"]["replicatedJobs"] if rj["name"] == role)
    pod: dict[str, Any] = rj["template"]["spec"]["template"]["spec"]
    return pod


def test_a_broken_render_names_every_violation(monkeypatch: pytest.MonkeyPatch) -> None:
    run = resolve(manifest({}))
    monkeypatch.setattr(placement, "tolerations", lambda: [{"key": 1, "operator": "Exists"}])
    with pytest.raises(render.RenderError) as err:
        render.jobset(run)
    where = "template.spec.template.spec.tolerations[0].key"
    assert str(err.value) == (
        "rendered JobSet fails JobSet's CRD schema:\n"
        f'spec.replicatedJobs[0].{where}: 1 is not of type "string"\n'
        f'spec.replicatedJobs[1].{where}: 1 is not of type "string"'
    )


@pytest.mark.parametrize(
    "spec",
    [{}, {"trainer": {"tpu": "v5p-16", "slices": 2}}, {"trainer": {"slices": 2}, "sampler": {"replicas": 2}}],
    ids=["one slice", "multislice", "multislice, two samplers"],
)
def test_no_pod_uses_the_host_network(spec: dict[str, Any]) -> None:
    """GKE gives host-network pods the node's identity, not the ServiceAccount's Workload Identity."""
    js = objects(manifest(spec))[-1]
    for role in ("trainer", "sampler"):
        pod = _pod(js, role)
        assert ("hostNetwork" in pod, "dnsPolicy" in pod) == (False, False), role
        assert pod["serviceAccountName"] == "t-rljob"


@pytest.mark.parametrize("words", [20, 8000])  # 100 and 40000 characters: past PyYAML's 80 and 2**15
def test_to_yaml_keeps_a_long_value_on_one_line(words: int) -> None:
    value = " ".join(["word"] * words)
    text = render.to_yaml([{"k": value}])
    assert text == f"---\nk: {value}\n"
    assert yaml.safe_load(text) == {"k": value}
