"""rljob.recipes.disk: each host's caches on an emptyDir sized from the model, not the writable layer."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fixtures.recipes import manifest, objects, recipe_manifest, resolve
from rljob.recipes import disk, podpolicy, recipe_catalog
from rljob.recipes.api import PodTemplate
from rljob.recipes.k8s_rules import quantity
from rljob.recipes.runconfig import CACHE_VOLUME, LOCAL_CACHE_DEFAULT

GIB = 2**30
GB = 10**9
DOC = Path(__file__).resolve().parents[2] / "docs" / "gke.md"

# recipe: (sampler weights in GB, sampler cache GiB per host, trainer cache GiB per host, trainer containers)
# The weights are the bf16 parameter count of the model's shapes (rljob.recipes.fit.params x 2 bytes):
# Qwen3-8B's and Llama 3.1 8B's are the sizes of their Hugging Face safetensors (16.4 GB, 16.1 GB). No
# catalog entry names spec.model.checkpoint, so each trainer host counts the conversion's scratch: the
# weights twice (the download and the converted leaves, both bf16 under the catalog's weight_dtype).
CATALOG = {
    "gemma4-31b-v5p": (61.4, 81, 144, 1),
    "gpt-oss-20b-v5p": (41.8, 61, 104, 1),
    "llama3.1-8b-v5p": (16.1, 35, 51, 1),
    "qwen3-0.6b-v5e": (1.2, 19, 21, 1),
    "qwen3-30b-a3b-tpu7x": (61.1, 81, 144, 2),
    "qwen3-8b-v5p": (16.4, 35, 52, 1),
    "qwen3-8b-v6e": (16.4, 35, 52, 1),
    "qwen3.5-397b-a17b-tpu7x": (792.7, 830, 1642, 2),
}


def test_the_table_covers_the_catalog() -> None:
    assert set(CATALOG) == set(recipe_catalog.names())


@pytest.mark.parametrize("recipe", sorted(CATALOG))
def test_sizes_per_catalog_recipe(recipe: str) -> None:
    weights_gb, sampler_gib, trainer_gib, trainer_containers = CATALOG[recipe]
    run = resolve(recipe_manifest(recipe))
    s, t = run.sampler.cache_disk, run.trainer.cache_disk
    assert round(s.parts["model_weights"] / GB, 1) == weights_gb
    # Every host of a replica holds the whole model (vLLM's TPU backend downloads every file on each host),
    # with the compilation cache and the headroom on top.
    assert s.bytes == sampler_gib * GIB
    assert s.bytes >= (s.parts["model_weights"] + disk.COMPILE_CACHE_BYTES) * (1 + disk.HEADROOM)
    assert s.size_limit == s.request == f"{sampler_gib}Gi"
    # The trainer converts the model itself: the Hugging Face files and the converted leaves at once, and its
    # compilation cache, split over its pod's TPU containers.
    weights = s.parts["model_weights"]
    assert t.parts == {
        "conversion_download": weights,
        "conversion_leaves": weights,
        "compilation_cache": disk.COMPILE_CACHE_BYTES,
    }
    assert t.bytes == trainer_gib * GIB and t.size_limit == f"{trainer_gib}Gi"
    assert t.request == f"{trainer_gib // trainer_containers}Gi" and trainer_gib % trainer_containers == 0
    assert t.source == s.source == "rljob"


@pytest.mark.parametrize(
    ("checkpoint", "weight_dtype", "want"),
    [
        (None, None, {"conversion_download": 2, "conversion_leaves": 2}),  # the catalog's: bf16 leaves
        (None, "float32", {"conversion_download": 2, "conversion_leaves": 4}),  # leaves in float32
        ("gs://b/qwen3-8b/0/items", None, {}),  # the user's conversion: orbax reads it from storage
    ],
)
def test_the_trainer_counts_its_conversion_only_where_it_converts(
    checkpoint: str | None, weight_dtype: str | None, want: dict[str, int]
) -> None:
    doc = recipe_manifest("qwen3-8b-v5p")
    if checkpoint:
        doc["spec"].setdefault("model", {})["checkpoint"] = checkpoint
    if weight_dtype:
        doc["spec"].setdefault("trainer", {}).setdefault("maxtext", {}).update(
            weight_dtype=weight_dtype, dtype=weight_dtype
        )
    run = resolve(doc)
    params = run.sampler.cache_disk.parts["model_weights"] // 2
    t = run.trainer.cache_disk
    assert t.parts == {
        **{k: v * params for k, v in want.items()},
        "compilation_cache": disk.COMPILE_CACHE_BYTES,
    }
    assert t.bytes == disk.sized(sum(t.parts.values()))


def test_the_397b_sampler_host_holds_its_weights() -> None:
    run = resolve(recipe_manifest("qwen3.5-397b-a17b-tpu7x"))
    assert run.sampler.tpu.hosts == 2
    per_host = quantity(run.sampler.cache_disk.request)
    assert per_host is not None and per_host >= 397e9 * 2  # 397B parameters in bf16, on each host


def _pods(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        rj["name"]: rj["template"]["spec"]["template"]["spec"] for rj in objs[-1]["spec"]["replicatedJobs"]
    }


@pytest.mark.parametrize("recipe", sorted(CATALOG))
def test_render_mounts_the_sized_emptydir_and_requests_it(recipe: str) -> None:
    """Fails on a render that leaves the caches in the writable layer."""
    doc = recipe_manifest(recipe)
    run = resolve(doc)
    for role, pod in _pods(objects(doc)).items():
        cache = (run.trainer if role == "trainer" else run.sampler).cache_disk
        (vol,) = [v for v in pod["volumes"] if v["name"] == CACHE_VOLUME]
        assert vol == {"name": CACHE_VOLUME, "emptyDir": {"sizeLimit": cache.size_limit}}
        requested = 0
        for c in pod["containers"]:
            assert {"name": CACHE_VOLUME, "mountPath": LOCAL_CACHE_DEFAULT} in c["volumeMounts"]
            requested += int(quantity(c["resources"]["requests"]["ephemeral-storage"]) or 0)
            assert "ephemeral-storage" not in c["resources"]["limits"]
        assert requested == cache.bytes  # the pod asks its node for what its emptyDir may hold
        # The operator's default pod policy accepts the pod's volumes as a template's.
        template = PodTemplate.model_validate({"spec": {"volumes": pod["volumes"]}})
        assert podpolicy.template_problems("p", template, "t-rljob", podpolicy.DEFAULT) == []


@pytest.mark.parametrize(
    ("role", "other", "tpu", "limit"),
    [("sampler", "trainer", "v5p-8", "200Gi"), ("trainer", "sampler", "tpu7x-8", "400Gi")],
    ids=["one container", "two containers per pod"],
)
def test_a_template_request_wins(role: str, other: str, tpu: str, limit: str) -> None:
    """The request is per container (as Kubernetes reads it); the pod's emptyDir may hold their sum."""
    template = {"spec": {"resources": {"requests": {"ephemeral-storage": "200Gi"}}}}
    doc = manifest({role: {"tpu": tpu, "template": template}})
    run = resolve(doc)
    cache = getattr(run, role).cache_disk
    assert (cache.source, cache.request, cache.size_limit) == ("template", "200Gi", limit)
    pod = _pods(objects(doc))[role]
    assert all(c["resources"]["requests"]["ephemeral-storage"] == "200Gi" for c in pod["containers"])
    (vol,) = [v for v in pod["volumes"] if v["name"] == CACHE_VOLUME]
    assert vol["emptyDir"] == {"sizeLimit": limit}
    assert getattr(run, other).cache_disk.source == "rljob"  # the other role keeps rljob's size


@pytest.mark.parametrize("field", ["volumes", "volumeMounts"])
def test_the_cache_volume_and_path_are_rljobs(field: str) -> None:
    from fixtures.recipes import problems

    if field == "volumes":
        spec = {"volumes": [{"name": CACHE_VOLUME, "emptyDir": {}}]}
    else:
        spec = {
            "volumes": [{"name": "x", "emptyDir": {}}],
            "volumeMounts": [{"name": "x", "mountPath": LOCAL_CACHE_DEFAULT}],
        }
    found = problems(manifest({"trainer": {"template": {"spec": spec}}}))
    # rljob's cache (and, for a mount, the pod policy's mount roots, which leave /tmp out)
    ours = [p for p in found if "mountRoots" not in p]
    assert len(ours) == 1 and ours[0].startswith(f"spec.trainer.template.spec.{field}[0]"), found


def test_allocatable_is_the_gke_page_example() -> None:
    """plan-node-sizes' example node: a 100 GB boot disk leaves 47060071478 bytes allocatable."""
    assert abs(disk.allocatable_bytes(100) - 47060071478) < 0.001 * 47060071478
    assert disk.allocatable_bytes(200) > disk.allocatable_bytes(100)


def _doc_table() -> dict[tuple[str, str], tuple[str, int]]:
    text = DOC.read_text()
    start = text.index("<!-- cache-disk table -->")
    rows = {}
    for line in text[start:].splitlines()[3:]:
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        rows[(cells[0], cells[1])] = (cells[3], int(cells[4]))
    return rows


def test_the_gke_doc_boot_disk_table_is_the_plans() -> None:
    """docs/gke.md's boot-disk table: each catalog recipe's pools, from the plan and disk.boot_disk_gb."""
    want = {}
    for recipe in recipe_catalog.names():
        run = resolve(recipe_manifest(recipe))
        for role, cache in (("trainer", run.trainer.cache_disk), ("sampler", run.sampler.cache_disk)):
            want[(recipe, role)] = (f"{cache.bytes // GIB} GiB", disk.boot_disk_gb(disk.pod_bytes(cache)))
    assert _doc_table() == want


def test_the_doc_names_the_default_disk() -> None:
    assert re.search(r"100 GB", DOC.read_text()) and disk.DEFAULT_BOOT_DISK_GB == 100
