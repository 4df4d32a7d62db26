"""The sweep of generated manifests (tests/fixtures/sweep.py; hack/sweep.py adds MaxText's full-size mesh):
an accepted manifest renders, passes the topology-only drill's process-topology check and scales to a
manifest the full drill can resolve; a refused one is refused with every line naming a spec field, and a
sampler layout refusal says what to set."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest
import yaml
from fixtures.sweep import MODELS, manifests
from rljob.cli import drill
from rljob.recipes import plan, render
from rljob.recipes.runconfig import RunConfig

LINE = re.compile(r"^spec(\.[A-Za-z0-9_-]+|\[\d+\])*: \S")
N = 200


def _outcomes() -> list[tuple[dict[str, Any], RunConfig | plan.PlanError]]:
    out: list[tuple[dict[str, Any], RunConfig | plan.PlanError]] = []
    for doc in manifests(N, seed=0):
        try:
            out.append((doc, plan.resolve(plan.parse_manifest(yaml.safe_dump(doc)))))
        except plan.PlanError as e:
            out.append((doc, e))
    return out


OUTCOMES = _outcomes()


def _family(doc: dict[str, Any]) -> str:
    model = doc["spec"].get("model") or {}
    name: str = model.get("maxtextModel") or model.get("name") or doc["spec"]["recipe"]
    return name.lower().split("/")[-1]


def test_the_sweep_covers_every_family_accepted_and_refused() -> None:
    accepted = Counter(_family(d) for d, r in OUTCOMES if not isinstance(r, plan.PlanError))
    refused = Counter(_family(d) for d, r in OUTCOMES if isinstance(r, plan.PlanError))
    assert sum(accepted.values()) >= N // 4 and sum(refused.values()) >= N // 4
    families = {"qwen3-", "gpt-oss", "gemma", "qwen3.5"}
    for fam in families:
        assert any(k.startswith(fam) for k in accepted), (fam, accepted)
    assert len(MODELS) >= 9


@pytest.mark.parametrize("i", range(N))
def test_an_accepted_manifest_passes_the_topology_check_and_a_refusal_names_fields(i: int) -> None:
    _, result = OUTCOMES[i]
    if isinstance(result, plan.PlanError):
        assert result.problems
        bad = [p for p in result.problems if not LINE.match(p)]
        assert not bad, bad
        return
    render.objects(result)
    full = drill.full_topology(result)
    assert full["processes"] * full["local_devices"] == result.trainer.devices
    # the full drill's scaled manifest resolves too (it is the drill's own, not the user's)
    small_doc, _ = drill.scaled_doc(OUTCOMES[i][0], result, steps=2)
    small = drill.resolve_doc(small_doc, fit_check=False)
    assert small.trainer.tpu.accelerator == result.trainer.tpu.accelerator
    assert drill.full_topology(small)["devices"] == small.trainer.devices


def test_a_sampler_layout_that_cannot_serve_the_model_says_what_to_set() -> None:
    """vLLM's TPU backend replicates KV heads where the tensor parallelism exceeds them (Qwen3-4B's 8 over
    16 devices, Qwen3.5-397B's 2 over 8, as vLLM's and Google's recipes serve it), but splits the gated
    delta net heads over every attention device: no layout of a 32-device replica serves Qwen3.5-397B, and
    the refusal names the slice that does (rljob.recipes.sampler_layout)."""
    from fixtures.recipes import MINIMAL

    def resolve(model: dict[str, str], sampler: dict[str, object]) -> RunConfig:
        doc = {**MINIMAL, "spec": {**MINIMAL["spec"], "model": model, "sampler": sampler}}
        # The layout rules alone: whether bf16 weights fit these slices is rljob.recipes.fit's question.
        return plan.resolve(plan.parse_manifest(yaml.safe_dump(doc)), fit_check=False)

    assert resolve({"name": "Qwen/Qwen3-4B"}, {"tpu": "tpu7x-16"}).sampler.tensor_parallel == 16
    q397 = {"name": "Qwen/Qwen3.5-397B-A17B", "maxtextModel": "qwen3.5-397b-a17b"}
    run = resolve(q397, {"tpu": "tpu7x-8", "tensorParallel": 8})
    assert (run.sampler.tensor_parallel, run.sampler.expert_parallel) == (8, 1)
    with pytest.raises(plan.PlanError) as e:
        resolve(q397, {"tpu": "tpu7x-32"})
    assert e.value.problems == [
        "spec.sampler.tensorParallel: 32 does not divide the 16 key and 64 value heads of "
        "qwen3.5-397b-a17b's gated delta net layers (vLLM's TPU backend splits them over every attention "
        "device)",
        "spec.sampler.tpu: no layout of the 32 devices of a tpu7x-32 replica serves qwen3.5-397b-a17b "
        "(vLLM's TPU backend splits its 32 attention heads, 2 KV heads, 16 gated delta net key heads over "
        "tensorParallel x expertParallel, and LoRA takes no dataParallel): use a sampler slice of at most 16 "
        "devices per replica (tpu7x-16), and more replicas",
    ]


def test_a_mesh_axis_the_recipes_custom_mesh_rule_lacks_is_refused_naming_both() -> None:
    """The Qwen3.5 recipe's cp-as-ep rule builds MaxText's mesh without a tensor axis: a tensor
    parallelism from the manifest used to validate and then fail MaxText's mesh at start."""
    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "t", "namespace": "ns"},
        "spec": {
            "recipe": "qwen3.5-397b-a17b-tpu7x",
            "trainer": {"mesh": {"fsdp": -1, "tensor": 2}},
            "storage": {"root": "gs://bucket/runs"},
        },
    }
    with pytest.raises(plan.PlanError) as e:
        plan.resolve(plan.parse_manifest(yaml.safe_dump(doc)))
    assert e.value.problems == [
        "spec.trainer.maxtext.custom_mesh_and_rule: cp-as-ep builds the mesh over data, stage, fsdp, "
        "context, expert only: spec.trainer.mesh.tensor 2 would leave devices out (MaxText refuses the mesh "
        "at start); set spec.trainer.mesh.tensor to 1 or use another rule (from recipe "
        "qwen3.5-397b-a17b-tpu7x)"
    ]
