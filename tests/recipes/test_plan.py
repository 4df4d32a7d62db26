"""The plan: recipe < profile < manifest, defaults, checks; every problem as `spec.path: message`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fixtures.recipes import MINIMAL, MISSING_AT_025, manifest, problems, recipe_manifest, resolve
from rljob.recipes import recipe_catalog
from rljob.recipes.runconfig import RunConfig

TESTED_MODULES = ("rljob.recipes.recipe_catalog",)

# ------------------------------------------------------------------ resolved values, table-driven

# spec overrides, then (dotted attribute path on RunConfig, expected value) pairs
GOOD: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (
        "minimal defaults",
        {},
        {
            "trainer.tpu.type_name": "v5p-8",
            "trainer.hosts": 1,
            "trainer.devices": 4,
            "trainer.ici.fsdp": 4,
            "trainer.dcn.data": 1,
            "trainer.micro_batch_size": 4,
            "sampler.tensor_parallel": 4,
            "sampler.max_model_len": 3072,
            "sampler.lora_max_rank": 16,
            "sampler.max_loras": 2,
            "spec.model.maxtext_model": "qwen3-8b",
            "spec.packing.token_budget": 3072,
            "spec.lora.alpha": 32.0,
            "spec.failure_policy.max_restarts": 3,
            "trainer.maxtext_version": "0.2.5",
            "storage.checkpoints": "gs://bucket/runs/ns/t/checkpoints",
            "storage.adapters": "gs://bucket/runs/ns/t/adapters",
            "storage.rollouts": "gs://bucket/runs/ns/t/rollouts",
            "storage.cache": "gs://bucket/runs/ns/t/cache",
            "endpoints.samplers": ["http://t-sampler-0-0.t:8000"],
            "endpoints.coordinator": "t-trainer-0-0.t:8482",
            "progress.config_map": "t-progress",
            "job_set_name": "t",
            "spec.dataset.task": "math",
            "spec.dataset.path": "gs://bucket/runs/data/train.jsonl",  # the root's, shared by its runs
            "spec.dataset.eval_size": 64,
        },
    ),
    (
        "dataset: explicit path; the toy task reads none",
        {"dataset": {"path": "/data/gsm8k.jsonl", "evalSize": 8}},
        {"spec.dataset.path": "/data/gsm8k.jsonl", "spec.dataset.eval_size": 8},
    ),
    (
        "dataset: the toy task",
        {"dataset": {"task": "successor"}},
        {"spec.dataset.task": "successor", "spec.dataset.path": None},
    ),
    (
        "two v5p-16 slices",
        {"trainer": {"tpu": "v5p-16", "slices": 2}},
        {
            "trainer.hosts": 4,
            "trainer.chips": 16,
            "trainer.devices": 16,
            "trainer.ici.fsdp": 8,
            "trainer.dcn.data": 2,
            "trainer.micro_batch_size": 16,
        },
    ),
    (
        "tpu7x trainer: 2 devices per chip, 2 containers",
        {"trainer": {"tpu": "tpu7x-16"}},
        {
            "trainer.devices": 16,
            "trainer.hosts": 2,
            "trainer.tpu.containers_per_host": 2,
            "trainer.tpu.chips_per_container": 2,
            "trainer.ici.fsdp": 16,
            "spec.trainer.containers_per_host": 2,
        },
    ),
    (
        "multi-host tpu7x pools are chosen by their workload policy too; single-host and v5p by topology",
        {"trainer": {"tpu": "tpu7x-16"}, "sampler": {"tpu": "tpu7x-8"}},
        {
            "trainer.tpu.placement_policy": "tpu7x-16-2x2x2-placement-policy",
            "sampler.tpu.placement_policy": None,
        },
    ),
    (
        "v5p multi-host: no workload policy",
        {"trainer": {"tpu": "v5p-16"}},
        {"trainer.tpu.placement_policy": None},
    ),
    (
        "tpu7x trainer with 1 container",
        {"trainer": {"tpu": "tpu7x-16", "containersPerHost": 1}},
        {
            "trainer.tpu.containers_per_host": 1,
            "trainer.tpu.chips_per_container": 4,
        },
    ),
    (
        "tpu7x sampler: TP = devices of one host",
        {"sampler": {"tpu": "tpu7x-8", "replicas": 3}},
        {
            "sampler.tensor_parallel": 8,
            "sampler.replicas": 3,
            "endpoints.samplers": [f"http://t-sampler-{i}-0.t:8000" for i in range(3)],
        },
    ),
    (
        "object form",
        {"trainer": {"tpu": {"accelerator": "tpu7x", "topology": "2x2x2"}}},
        {
            "trainer.tpu.type_name": "tpu7x-16",
        },
    ),
    (
        "explicit mesh and micro-batch",
        {"trainer": {"tpu": "v5p-32", "mesh": {"fsdp": 4, "tensor": -1}, "microBatchSize": 8}},
        {
            "trainer.ici.tensor": 4,
            "trainer.micro_batch_size": 8,
            "trainer.maxtext.per_device_batch_size": 0.5,
            "trainer.maxtext.ici_tensor_parallelism": 4,
        },
    ),
    (
        "model checkpoint: the trainer reads spec.model.checkpoint, not a MaxText key",
        {"model": {"checkpoint": "gs://ckpt/qwen3-8b/0/items"}},
        {
            "spec.model.checkpoint": "gs://ckpt/qwen3-8b/0/items",
        },
    ),
    (
        "packing budget rounds up to 128",
        {"algorithm": {"maxPromptTokens": 1000, "maxTokens": 1000}},
        {
            "spec.packing.token_budget": 2048,
            "trainer.maxtext.max_target_length": 2048,
            "sampler.max_model_len": 2048,  # rounded up to 128 too
        },
    ),
]


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


@pytest.mark.parametrize(("name", "spec", "expected"), GOOD, ids=[g[0] for g in GOOD])
def test_resolves(name: str, spec: dict[str, Any], expected: dict[str, Any]) -> None:
    run = resolve(manifest(spec))
    assert {k: _get(run, k) for k in expected} == expected


# ------------------------------------------------------------------ refused manifests, exact lines

BAD: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "nothing",
        {"model": None, "trainer": None, "sampler": None, "storage": None},
        [
            "spec.model.name: required (set it, or name a spec.recipe that does)",
            "spec.trainer.tpu: required (set it, or name a spec.recipe that does)",
            "spec.sampler.tpu: required (set it, or name a spec.recipe that does)",
            "spec.storage.root: required (set it, or name a spec.recipe that does)",
        ],
    ),
    (
        "unknown recipe",
        {"recipe": "llama-9000"},
        [
            "spec.recipe: unknown recipe 'llama-9000'; known: " + ", ".join(recipe_catalog.names()),
        ],
    ),
    (
        "profile without recipe",
        {"trainer": {"profile": "fast"}},
        [
            "spec.trainer.profile: a profile belongs to a recipe; set spec.recipe",
        ],
    ),
    (
        "unknown profile",
        {"recipe": "qwen3-8b-v5p", "trainer": {"profile": "fast"}},
        [
            "spec.trainer.profile: recipe qwen3-8b-v5p has no profile 'fast'; profiles: long-context",
        ],
    ),
    (
        "bad tpu",
        {"trainer": {"tpu": "v5p-12"}, "sampler": {"tpu": "v4-8"}},
        [
            "spec.trainer.tpu: 'v5p-12': no v5p slice has 6 chips; valid sizes start v5p-8, v5p-16, "
            "v5p-32, v5p-64, "
            "v5p-128, v5p-256, v5p-384, v5p-512, ...",
            "spec.sampler.tpu: unknown TPU type 'v4-8'; expected v5p-N, tpu7x-N, v5litepod-N, v6e-N (N = "
            "TensorCores: 2 per v5p chip, 2 per tpu7x chip, 1 per v5litepod chip, 1 per v6e chip), or "
            "{accelerator, topology}",
        ],
    ),
    (
        "mesh does not fit",
        {"trainer": {"mesh": {"fsdp": 8}}},
        [
            "spec.trainer.mesh: the axes multiply to 8 (fsdp 8) but must equal the 4 devices of one slice",
        ],
    ),
    (
        "micro-batch",
        {"trainer": {"tpu": "v5p-16", "microBatchSize": 12}},
        [
            "spec.trainer.microBatchSize: 12 rows do not split evenly over data x fsdp x expert = 8 shards, "
            "over which MaxText splits a micro-batch's rows (Splash attention needs them even): use a "
            "multiple of 8",
        ],
    ),
    (
        "micro-batch over an expert axis: the rows split over data x fsdp x expert (Splash's shard_map)",
        {
            "model": {"name": "openai/gpt-oss-20b", "maxtextModel": "gpt-oss-20b"},
            "trainer": {"tpu": "v5p-16", "mesh": {"fsdp": -1, "expert": 2}, "microBatchSize": 4},
        },
        [
            "spec.trainer.microBatchSize: 4 rows do not split evenly over data x fsdp x expert = 8 shards, "
            "over which MaxText splits a micro-batch's rows (Splash attention needs them even): use a "
            "multiple of 8",
        ],
    ),
    (
        "sampler tp",
        {"sampler": {"tensorParallel": 3}},
        [
            "spec.sampler.tensorParallel: 3 x dataParallel 1 x expertParallel 1 = 3 is not the 4 devices of "
            "a v5p-8 sampler replica",
            "spec.sampler.tensorParallel: 3 does not divide the 32 attention heads of qwen3-8b (vLLM refuses "
            "a tensor-parallel size that does not divide them)",
            "spec.sampler.tensorParallel: 3 does not divide the 8 KV heads of qwen3-8b",
            "spec.sampler.tensorParallel: a v5p-8 replica of qwen3-8b can be laid out as tensorParallel 4 x "
            "expertParallel 1",
        ],
    ),
    (
        "sampler layout of a dense model",
        {"sampler": {"tensorParallel": 2, "expertParallel": 2}},
        [
            "spec.sampler.expertParallel: 2, but qwen3-8b has no experts",
            "spec.sampler.tensorParallel: a v5p-8 replica of qwen3-8b can be laid out as tensorParallel 4 x "
            "expertParallel 1",
        ],
    ),
    (
        "a replica larger than the model's gated delta net heads: no layout, the slice to use instead",
        {
            "model": {"maxtextModel": "qwen3.5-397b-a17b"},
            "trainer": {"tpu": "v5p-64"},  # holds the model (rljob.recipes.fit)
            "sampler": {"tpu": "tpu7x-32"},
        },
        [
            "spec.sampler.tensorParallel: 32 does not divide the 16 key and 64 value heads of "
            "qwen3.5-397b-a17b's gated delta net layers (vLLM's TPU backend splits them over every attention "
            "device)",
            "spec.sampler.tpu: no layout of the 32 devices of a tpu7x-32 replica serves qwen3.5-397b-a17b "
            "(vLLM's TPU backend splits its 32 attention heads, 2 KV heads, 16 gated delta net key heads "
            "over tensorParallel x expertParallel, and LoRA takes no dataParallel): use a sampler slice of "
            "at most 16 devices per replica (tpu7x-16), and more replicas",
        ],
    ),
    (
        "sampler experts and data parallel, every problem at once",
        {
            "model": {"maxtextModel": "gpt-oss-20b"},
            "sampler": {"tpu": "tpu7x-16", "tensorParallel": 1, "expertParallel": 8, "dataParallel": 3},
        },
        [
            "spec.sampler.tensorParallel: 1 x dataParallel 3 x expertParallel 8 = 24 is not the 16 devices "
            "of a tpu7x-16 sampler replica",
            "spec.sampler.dataParallel: 3; vLLM's TPU backend serves LoRA adapters only without data "
            "parallelism (use tensorParallel / expertParallel, or more replicas)",
            "spec.sampler.tensorParallel: a tpu7x-16 replica of gpt-oss-20b can be laid out as "
            "tensorParallel 16 x expertParallel 1",
        ],
    ),
    (
        "gated delta net layers under context parallelism: an explicit load-balancing reorder is refused",
        {
            "model": {"maxtextModel": "qwen3.5-35b-a3b"},
            "trainer": {
                "mesh": {"fsdp": -1, "context": 2},
                "maxtext": {"context_parallel_load_balance": True},
            },
            "sampler": {"tensorParallel": 2, "expertParallel": 2},
        },
        [
            "spec.trainer.maxtext.context_parallel_load_balance: the qwen3_5 decoder's gated delta net "
            "layers with context parallelism 2 need context_parallel_load_balance=false: their recurrence "
            "runs in device order, which the load-balancing reorder breaks, and MaxText refuses it at start",
        ],
    ),
    (
        "load-balanced context parallelism: the token budget must split in 2 x context chunks",
        {
            "trainer": {"mesh": {"fsdp": 2, "context": 2}, "microBatchSize": 4},
            "packing": {"tokenBudget": 4098},
        },
        [
            "spec.trainer.maxtext.context_parallel_load_balance: load-balanced context parallelism 2 needs "
            "an even context axis and a token budget (max_target_length, spec.packing.tokenBudget) "
            "divisible by 4, it is 4098; set context_parallel_load_balance=false or change the context axis",
        ],
    ),
    (
        "two containers per host on v5p: the containers are named, not the valid TPU shape",
        {"trainer": {"containersPerHost": 2}},
        ["spec.trainer.containersPerHost: two containers per host need a 4-chip tpu7x host, not v5p 2x2x1"],
    ),
    (
        "sampler len",
        {"sampler": {"maxModelLen": 2048}},
        [
            "spec.sampler.maxModelLen: 2048 is below maxPromptTokens + maxTokens = 3072",
        ],
    ),
    (
        "lora rank",
        {"lora": {"rank": 24}},
        [
            "spec.lora.rank: 24 is not a vLLM LoRA rank (1, 8, 16, 32, 64, 128, 256, 320, 512)",
        ],
    ),
    (
        "packing",
        {"packing": {"tokenBudget": 2048, "segmentAlign": 4096}},
        [
            "spec.packing.tokenBudget: 2048 is below maxPromptTokens + maxTokens = 3072: a full-length "
            "sequence would "
            "not fit a packed row",
            "spec.packing.segmentAlign: 4096 exceeds the token budget 2048",
        ],
    ),
    (
        "pad align with end does nothing",
        {"packing": {"padAlign": 2048}},
        [
            "spec.packing.padAlign: 2048 is only read with padPosition start or balanced; with end it would "
            "do nothing (remove it, or set padPosition: start)",
        ],
    ),
    (
        "pad align not a multiple of the segment alignment",
        {"packing": {"padPosition": "start", "tokenBudget": 8192, "segmentAlign": 96, "padAlign": 4096}},
        ["spec.packing.padAlign: 4096 is not a multiple of segmentAlign 96"],
    ),
    (
        "pad align at least the row: start never moves a row",
        {"packing": {"padPosition": "start", "tokenBudget": 4096, "padAlign": 4096}},
        [
            "spec.packing.padAlign: 4096 is not below the token budget 4096: padPosition start "
            "would never move a row; set padAlign to a multiple of segmentAlign 64 below 4096 (e.g. 2048) or "
            "raise spec.packing.tokenBudget above it",
        ],
    ),
    (
        "balanced, a small budget, an explicit pad align that never fits: the message says what to set",
        {
            "algorithm": {"maxTokens": 512, "maxPromptTokens": 256},
            "packing": {"padPosition": "balanced", "tokenBudget": 1024, "padAlign": 4096},
        },
        [
            "spec.packing.padAlign: 4096 is not below the token budget 1024: padPosition "
            "balanced would never move a row; set padAlign to a multiple of segmentAlign 64 below 1024 "
            "(e.g. 512) or raise spec.packing.tokenBudget above it",
        ],
    ),
    (
        "balanced rows must split into whole Splash blocks of every context chunk",
        {"packing": {"padPosition": "balanced", "tokenBudget": 3584, "padAlign": 2048}},
        [
            f"spec.packing.tokenBudget: 3584 must be a multiple of 2 x context 1 x {q} 512 and of {k} 512 "
            "for padPosition balanced (the next budget that fits every kernel: 4096)"
            for q, k in (("sa_block_q", "sa_block_kv"), ("sa_block_q_dkv", "sa_block_kv_dkv"))
        ],
    ),
    (
        "a row Splash attention's blocks do not split (MaxText's 512 by default)",
        {"packing": {"tokenBudget": 4160}},
        [
            "spec.packing.tokenBudget: 4160 does not split into whole Splash attention blocks ("
            "sa_block_q 512, sa_block_q_dkv 512, sa_block_q_dq 512, sa_block_kv 512, sa_block_kv_compute "
            "512, sa_block_kv_dkv 512, sa_block_kv_dkv_compute 512, sa_block_kv_dq 512) over a row: use a "
            "multiple of 512, or set those spec.trainer.maxtext keys to divide it"
        ],
    ),
    (
        "a manifest's Splash block that does not divide the row",
        {
            "packing": {"tokenBudget": 5120},
            "trainer": {"maxtext": {"sa_block_q": 2048, "sa_block_kv_dq": 1024}},
        },
        [
            "spec.packing.tokenBudget: 5120 does not split into whole Splash attention blocks ("
            "sa_block_q 2048) over a row: use a multiple of 2048, or set those spec.trainer.maxtext keys to "
            "divide it"
        ],
    ),
    (
        "dataset path and template",
        {"dataset": {"path": "train.jsonl", "promptTemplate": "{prompt}"}},
        [
            "spec.dataset.path: must be a gs://BUCKET/OBJECT or an absolute path to a file",
            "spec.dataset.promptTemplate: must be a format string whose only field is {question}, without "
            "a format spec or conversion (found '{prompt}'; write {{ and }} for literal braces)",
        ],
    ),
    (
        "dataset path of the toy task",
        {"dataset": {"task": "successor", "path": "gs://b-1/x.jsonl"}},
        [
            "spec.dataset.path: task successor generates its prompts and reads no file (remove path, or set "
            "task: math)",
        ],
    ),
    (
        "maxtext keys",
        {
            "trainer": {
                "maxtext": {
                    "use_ring_of_expert": True,
                    "ici_fsdp_parallelism": 2,
                    "moe_chunk_pipeline": True,
                    "num_moe_token_chunks": 2,
                }
            }
        },
        [
            "spec.trainer.maxtext.use_ring_of_expert: not a MaxText 0.2.5 config key (did you mean "
            "use_ring_of_experts?)",
            "spec.trainer.maxtext.ici_fsdp_parallelism: set by rljob from spec.trainer.mesh; set that "
            "instead",
            "spec.trainer.maxtext.moe_chunk_pipeline: not a MaxText 0.2.5 config key",
            "spec.trainer.maxtext.num_moe_token_chunks: 2 chunks require use_ring_of_experts=true",
        ],
    ),
    (
        "maxtext version",
        {"trainer": {"maxtextVersion": "0.3.0"}},
        [
            "spec.trainer.maxtextVersion: no MaxText key list for '0.3.0'; known: 0.2.5",
        ],
    ),
    (
        "maxtext model",
        {"model": {"name": "acme/Foo-7B"}},
        [
            "spec.model.maxtextModel: 'foo-7b' is not a MaxText 0.2.5 model name",
        ],
    ),
    (
        "model yml override",
        {"trainer": {"maxtext": {"base_num_kv_heads": 2}}},
        [
            "spec.trainer.maxtext.base_num_kv_heads: the qwen3-8b model config sets base_num_kv_heads=8; "
            "MaxText "
            "refuses another value unless override_model_config=true",
        ],
    ),
    (
        "schema",
        {
            "trainer": {"slices": 0, "bogus": 1, "tpu": {"accelerator": "tpu-v6e", "topology": "2x2x1"}},
            "storage": {"root": "s3://x"},
            "algorithm": {"loss": "dpo"},
        },
        [
            "spec.trainer.tpu.accelerator: Input should be 'tpu-v5p-slice', 'tpu7x', "
            "'tpu-v5-lite-podslice' or 'tpu-v6e-slice'",
            "spec.trainer.slices: Input should be greater than or equal to 1",
            "spec.trainer.bogus: unknown field",
            "spec.algorithm.loss: Input should be 'importance_sampling' or 'ppo'",
            "spec.storage.root: must be gs://BUCKET or gs://BUCKET/PREFIX (bucket: 3-63 lowercase "
            "letters, digits, "
            "'-', '_', '.')",
        ],
    ),
]


@pytest.mark.parametrize(("name", "spec", "expected"), BAD, ids=[b[0] for b in BAD])
def test_refused(name: str, spec: dict[str, Any], expected: list[str]) -> None:
    assert problems(manifest(spec)) == expected


@pytest.mark.parametrize(
    ("spec", "refused"),
    [
        ({"packing": {"tokenBudget": 4096}}, False),
        ({"packing": {"tokenBudget": 4608}}, False),  # 9 blocks of 512
        ({"packing": {"tokenBudget": 4608}, "trainer": {"maxtext": {"sa_block_q": 1024}}}, True),
        ({"packing": {"tokenBudget": 4160}, "trainer": {"maxtext": {"attention": "dot_product"}}}, False),
        # a block longer than the row is clamped to it (MaxText's attention_op), as for a short budget
        ({"packing": {"tokenBudget": 4096}, "trainer": {"maxtext": {"sa_block_kv": 8192}}}, False),
    ],
)
def test_splash_blocks_must_split_the_row(spec: dict[str, Any], refused: bool) -> None:
    lines = [p for p in problems(manifest(spec)) if "Splash attention blocks" in p]
    assert bool(lines) == refused, lines


def test_the_v5e_recipe_tuned_splash_refuses_a_budget_its_blocks_do_not_split() -> None:
    doc = recipe_manifest("qwen3-0.6b-v5e")
    assert not problems(doc)
    doc["spec"]["packing"] = {"tokenBudget": 5632}
    assert problems(doc) == [
        "spec.packing.tokenBudget: 5632 does not split into whole Splash attention blocks (sa_block_q "
        "1024, sa_block_q_dkv 1024, sa_block_q_dq 1024, sa_block_kv 1024, sa_block_kv_compute 1024, "
        "sa_block_kv_dkv 1024, sa_block_kv_dkv_compute 1024, sa_block_kv_dq 1024) over a row: use a "
        "multiple of 1024, or set those spec.trainer.maxtext keys to divide it"
    ]


def test_name_too_long() -> None:
    got = problems(manifest({}, name="a" * 26))
    assert got == [
        "metadata.name: too long: the coordinator label "
        f"'{'a' * 26}-trainer-0-0.{'a' * 26}' has 65 characters (max 63); use a name of at most 25 characters"
    ]


def test_all_problems_at_once() -> None:
    got = problems(
        manifest(
            {
                "lora": {"rank": 3},
                "sampler": {"tensorParallel": 5},
                "trainer": {"mesh": {"tensor": 3}, "maxtext": {"nope": 1}},
            },
            name="x" * 30,
        )
    )
    assert [p.split(":")[0] for p in got] == [
        "spec.lora.rank",
        "spec.sampler.tensorParallel",  # 5 is not the 4 devices,
        "spec.sampler.tensorParallel",  # nor divides the 32 attention heads
        "spec.sampler.tensorParallel",  # nor the 8 KV heads
        "spec.sampler.tensorParallel",  # the layout to set instead
        "spec.trainer.mesh",
        "spec.trainer.maxtext.nope",
        "metadata.name",
    ]


# ------------------------------------------------------------------ precedence and sources


def test_precedence_recipe_profile_manifest() -> None:
    doc = recipe_manifest("qwen3.5-397b-a17b-tpu7x", "256-chips-ep1")
    doc["spec"]["trainer"]["maxtext"] = {"sa_block_q": 2048, "num_vocab_tiling": None}
    run = resolve(doc)
    t = run.trainer
    assert (t.tpu.type_name, t.ici.fsdp, t.ici.expert, t.ici.context) == ("tpu7x-512", 64, 1, 8)
    assert (t.maxtext["num_moe_token_chunks"], t.maxtext_sources["num_moe_token_chunks"]) == (1, "profile")
    assert (t.maxtext["sa_block_q"], t.maxtext_sources["sa_block_q"]) == (2048, "manifest")
    assert (t.maxtext["use_ring_of_experts"], t.maxtext_sources["use_ring_of_experts"]) == (True, "recipe")
    assert t.maxtext_sources["ici_fsdp_parallelism"] == "rljob"
    assert "num_vocab_tiling" not in t.maxtext  # a manifest null removes a recipe key
    assert set(t.maxtext_sources) == set(t.maxtext)


def test_recipe_key_errors_name_their_source() -> None:
    doc = recipe_manifest("qwen3.5-397b-a17b-tpu7x")
    doc["spec"]["packing"] = {"tokenBudget": 65537}
    src = " (from recipe qwen3.5-397b-a17b-tpu7x)"
    assert problems(doc) == [
        "spec.trainer.maxtext.num_moe_token_chunks: max_target_length 65537 (the packing token budget) "
        "is not "
        f"divisible by num_moe_token_chunks 2{src}",
        "spec.trainer.maxtext.num_vocab_tiling: per_device_batch_size x max_target_length = 8192.125 is not "
        f"divisible by num_vocab_tiling 16{src}",
        "spec.trainer.maxtext.context_parallel_strategy: ring context parallelism 8 needs "
        "max_target_length % 64 == "
        f"0, max_target_length is 65537{src}",
    ]


def test_seed_block_keys_missing_at_025_are_refused() -> None:
    """The seed's tuned 397B keys that MaxText 0.2.5 lacks are refused with the key named."""
    missing = MISSING_AT_025
    doc = recipe_manifest("qwen3.5-397b-a17b-tpu7x")
    doc["spec"]["trainer"] = {"maxtext": dict.fromkeys(missing, True)}
    got = problems(doc)
    assert [p.split(" (did you mean")[0] for p in got] == [
        f"spec.trainer.maxtext.{k}: not a MaxText 0.2.5 config key" for k in missing
    ]


# ------------------------------------------------------------------ catalog


@pytest.mark.parametrize("name", recipe_catalog.names())
def test_every_recipe_and_profile_resolves(name: str) -> None:
    recipe = recipe_catalog.load(name)
    for profile in [None, *recipe.profiles]:
        run = resolve(recipe_manifest(name, profile))
        assert run.trainer.ici.product() == run.trainer.tpu.devices


@pytest.mark.parametrize("name", recipe_catalog.names())
def test_a_recipe_on_an_experimental_vllm_generation_says_so(name: str) -> None:
    """tpu-inference lists v5p as experimental: a recipe whose samplers run there says it."""
    from rljob.recipes.tpu import BY_ACCELERATOR

    recipe = recipe_catalog.load(name)
    run = resolve(recipe_manifest(name))
    support = BY_ACCELERATOR[run.sampler.tpu.accelerator].vllm_tpu_support
    assert support in ("recommended", "experimental")
    says = f"lists {BY_ACCELERATOR[run.sampler.tpu.accelerator].prefix} as experimental" in recipe.description
    assert says == (support == "experimental"), (name, support)


def test_vllm_tpu_support_of_each_generation() -> None:
    from rljob.recipes.tpu import GENERATIONS

    assert {p: g.vllm_tpu_support for p, g in GENERATIONS.items()} == {
        "v5p": "experimental",
        "tpu7x": "recommended",
        "v5litepod": "recommended",
        "v6e": "recommended",
    }


def test_catalog_397b_meshes() -> None:
    shapes = {}
    for profile in (None, "256-chips-ep2", "256-chips-ep1"):
        t = resolve(recipe_manifest("qwen3.5-397b-a17b-tpu7x", profile)).trainer
        shapes[profile] = (
            t.tpu.chips,
            t.devices,
            t.ici.fsdp,
            t.ici.expert,
            t.ici.context,
            t.maxtext["num_moe_token_chunks"],
        )
    assert shapes == {
        None: (128, 256, 16, 2, 8, 2),
        "256-chips-ep2": (256, 512, 32, 2, 8, 2),
        "256-chips-ep1": (256, 512, 64, 1, 8, 1),
    }


def test_runconfig_roundtrip(tmp_path: Path) -> None:
    run = resolve(MINIMAL)
    path = tmp_path / "run.json"
    path.write_text(run.model_dump_json(), encoding="utf-8")
    assert RunConfig.load(path) == run
