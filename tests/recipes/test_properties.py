"""Properties over generated manifests: no accepted spec renders a JobSet that fails JobSet's CRD
schema or a name over 63 characters; no input crashes, every refusal is `path: message` lines."""

from __future__ import annotations

import re
from typing import Any

from fixtures.recipes import manifest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from rljob.recipes import plan, render, schema
from rljob.recipes.api import RLJob

LINE = re.compile(
    r'^(metadata|spec|apiVersion|kind|status|\(root\)|\(yaml\))(\.[A-Za-z0-9_-]+|\[\d+\]|\["(?:[^"\\]|\\.)*"\])*'
    r": \S[^\n]*$"
)
NONE = st.none()
AXIS = st.one_of(NONE, st.sampled_from([-1, 0, 1, 2, 3, 4, 8, 16, 32, 64]))
TPU = st.one_of(
    st.sampled_from(
        [
            "v5p-8",
            "v5p-16",
            "v5p-32",
            "v5p-128",
            "tpu7x-2",
            "tpu7x-8",
            "tpu7x-16",
            "tpu7x-256",
            "tpu7x-512",
            "v5p-12",
            "v6e-8",
            "tpu7x-4x4x4",
            "v5p-2x2x2",
            "x",
            "",
        ]
    ),
    st.fixed_dictionaries(
        {
            "accelerator": st.sampled_from(["tpu-v5p-slice", "tpu7x", "tpu-v6e-slice"]),
            "topology": st.sampled_from(["2x2x1", "2x2x2", "4x4x4", "1x1x1", "4x4x2", "8"]),
        }
    ),
    st.integers(),
    NONE,
)
MAXTEXT = st.dictionaries(
    st.sampled_from(
        [
            "remat_policy",
            "attention",
            "num_moe_token_chunks",
            "use_ring_of_experts",
            "num_vocab_tiling",
            "moe_chunk_pipeline",
            "ici_fsdp_parallelism",
            "sa_block_q",
            "nope_key",
            "use_ragged_sort",
            "ragged_buffer_factor",
            "context_parallel_strategy",
            "base_num_kv_heads",
        ]
    ),
    st.one_of(
        st.integers(-2, 70000), st.booleans(), st.sampled_from(["full", "ring", "flash", "none"]), NONE
    ),
    max_size=5,
)


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


SPEC = st.fixed_dictionaries(
    {},
    optional={
        "recipe": st.sampled_from(["qwen3-8b-v5p", "qwen3.5-397b-a17b-tpu7x", "gpt-oss-20b-v5p", "nope"]),
        "trainer": st.builds(
            lambda tpu, slices, mesh, micro, mt, prof, cph: _drop_none(
                {
                    "tpu": tpu,
                    "slices": slices,
                    "mesh": mesh,
                    "microBatchSize": micro,
                    "maxtext": mt,
                    "profile": prof,
                    "containersPerHost": cph,
                }
            ),
            TPU,
            st.one_of(NONE, st.integers(0, 5)),
            st.one_of(
                NONE,
                st.builds(
                    lambda *a: _drop_none(
                        dict(zip(("data", "fsdp", "tensor", "context", "expert"), a, strict=True))
                    ),
                    AXIS,
                    AXIS,
                    AXIS,
                    AXIS,
                    AXIS,
                ),
            ),
            st.one_of(NONE, st.integers(0, 300)),
            st.one_of(NONE, MAXTEXT),
            st.one_of(NONE, st.sampled_from(["256-chips-ep1", "256-chips-ep2", "long-context", "nope"])),
            st.one_of(NONE, st.integers(0, 3)),
        ),
        "sampler": st.builds(
            lambda tpu, rep, tp, mml: _drop_none(
                {"tpu": tpu, "replicas": rep, "tensorParallel": tp, "maxModelLen": mml}
            ),
            TPU,
            st.one_of(NONE, st.integers(0, 300)),
            st.one_of(NONE, st.integers(0, 64)),
            st.one_of(NONE, st.integers(0, 100000)),
        ),
        "lora": st.builds(lambda r: {"rank": r}, st.integers(-1, 600)),
        "packing": st.builds(
            lambda b, s, p, a: _drop_none(
                {"tokenBudget": b, "segmentAlign": s, "padPosition": p, "padAlign": a}
            ),
            st.one_of(NONE, st.integers(0, 70000)),
            st.one_of(NONE, st.integers(0, 8192)),
            st.one_of(NONE, st.sampled_from(["end", "start", "balanced"])),
            st.one_of(NONE, st.integers(0, 8192)),
        ),
        "storage": st.builds(
            lambda r: {"root": r}, st.sampled_from(["gs://bkt", "gs://b", "s3://bkt", "gs://bkt/a/b"])
        ),
        "model": st.builds(
            lambda n: {"name": n}, st.sampled_from(["Qwen/Qwen3-8B", "acme/x", "qwen3-4b", ""])
        ),
    },
)
NAME = st.from_regex(r"[a-z][a-z0-9-]{0,40}[a-z0-9]", fullmatch=True)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=SPEC, name=NAME)
def test_accepted_specs_render_valid_jobsets(spec: dict[str, Any], name: str) -> None:
    doc = manifest(spec, name=name)
    try:
        job = RLJob.model_validate(doc)
        objs = render.render(job)
    except plan.PlanError as e:
        assert e.problems and all(LINE.match(p) for p in e.problems), e.problems
        return
    except Exception as e:
        from pydantic import ValidationError

        assert isinstance(e, ValidationError), repr(e)
        assert all(LINE.match(p) for p in plan.pydantic_problems(e)), plan.pydantic_problems(e)
        return
    event("rendered")
    *_, jobset = objs
    kinds = ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "NetworkPolicy", "JobSet"]
    assert [o["kind"] for o in objs] == kinds
    assert all(len(o["metadata"]["name"]) <= 63 for o in objs)
    assert schema.validate_jobset(jobset) == []
    js = jobset["metadata"]["name"]
    for rj in jobset["spec"]["replicatedJobs"]:
        last = f"{js}-{rj['name']}-{rj['replicas'] - 1}-{rj['template']['spec']['completions'] - 1}"
        assert len(last + "-xxxxx") <= 63
        assert rj["template"]["spec"]["parallelism"] == rj["template"]["spec"]["completions"]
    assert len(f"{js}-trainer-0-0.{jobset['spec']['network']['subdomain']}") <= 63


YAMLISH = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)),
    lambda kids: st.one_of(
        st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=8), kids, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_no_text_crashes_the_parser(text: str) -> None:
    try:
        plan.parse_manifest(text)
    except plan.PlanError as e:
        assert e.problems and all(LINE.match(p) for p in e.problems), e.problems


@settings(max_examples=200, deadline=None)
@given(spec=YAMLISH, meta=YAMLISH)
def test_no_tree_crashes_the_planner(spec: Any, meta: Any) -> None:
    doc = {"apiVersion": "rljob.dev/v1alpha1", "kind": "RLJob", "metadata": meta, "spec": spec}
    import yaml

    try:
        job = plan.parse_manifest(yaml.safe_dump(doc))
        plan.resolve(job)
    except plan.PlanError as e:
        assert e.problems and all(LINE.match(p) for p in e.problems), e.problems
