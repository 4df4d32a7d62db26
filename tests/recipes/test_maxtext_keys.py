"""MaxText key sets and inter-key rules.

The committed key list must equal what hack/gen_maxtext_keys.py produces from the installed maxtext
(regenerate: `.venv/bin/python hack/gen_maxtext_keys.py`)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest
from fixtures.recipes import MISSING_AT_025
from rljob.recipes import maxtext_keys

REPO = Path(__file__).resolve().parents[2]


def test_committed_list_matches_installed_maxtext() -> None:
    import maxtext  # noqa: F401  (pinned in the trainer extra: its absence fails)

    spec = importlib.util.spec_from_file_location("gen_maxtext_keys", REPO / "hack" / "gen_maxtext_keys.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    version, doc = gen.build()
    committed = (REPO / "recipes" / "data" / f"maxtext-{version}-keys.json").read_text(encoding="utf-8")
    assert gen.render(doc) == committed, "run .venv/bin/python hack/gen_maxtext_keys.py"


def test_key_set_025() -> None:
    ks = maxtext_keys.load("0.2.5")
    assert maxtext_keys.versions() == ["0.2.5"]
    assert len(ks.defaults) == 865
    for k in (
        "ici_fsdp_parallelism",
        "num_moe_token_chunks",
        "use_ring_of_experts",
        "num_vocab_tiling",
        "wi_tile_fwd_batch_seq",
        "sa_block_q",
        "custom_mesh_and_rule",
    ):
        assert k in ks
    assert [k for k in MISSING_AT_025 if k in ks] == []
    assert ks.defaults["ici_fsdp_parallelism"] == -1 and ks.defaults["dcn_data_parallelism"] == -1
    assert "qwen3.5-397b-a17b" in ks.models and ks.models["qwen3-8b"]["base_num_kv_heads"] == 8
    assert ks.suggest("use_ring_of_expert") == ["use_ring_of_experts"]
    with pytest.raises(KeyError):
        maxtext_keys.load("9.9.9")


# A key set of a newer MaxText that defines the chunk-pipeline keys (e95312a3 / #5758 style).
NEWER = maxtext_keys.KeySet(
    version="newer",
    defaults={
        **maxtext_keys.load("0.2.5").defaults,
        "moe_chunk_pipeline": False,
        "moe_roe_packed_routing_gather": False,
        "ring_of_experts_local_routing": False,
        "ring_of_experts_row_major_reduce_scatter": False,
        "moe_expert_weight_prefetch": None,
    },
    models=maxtext_keys.load("0.2.5").models,
)
OK_BASE: dict[str, Any] = {"max_target_length": 65536, "per_device_batch_size": 0.25}
ROE: dict[str, Any] = {"use_ring_of_experts": True, "use_ragged_sort": True}

RULES = [
    ({}, []),
    ({"num_moe_token_chunks": 2}, [("num_moe_token_chunks", "2 chunks require use_ring_of_experts=true")]),
    ({**ROE, "num_moe_token_chunks": 2}, []),
    (
        {**ROE, "num_moe_token_chunks": 3},
        [
            (
                "num_moe_token_chunks",
                "max_target_length 65536 (the packing token budget) is not divisible by "
                "num_moe_token_chunks 3",
            )
        ],
    ),
    ({**ROE, "num_moe_token_chunks": 2, "moe_chunk_pipeline": True}, []),
    (
        {**ROE, "num_moe_token_chunks": 1, "moe_chunk_pipeline": True},
        [("moe_chunk_pipeline", "requires num_moe_token_chunks > 1 (set it false at one chunk)")],
    ),
    (
        {**ROE, "num_moe_token_chunks": 2, "moe_chunk_pipeline": True, "moe_chunk_barrier": True},
        [("moe_chunk_pipeline", "requires moe_chunk_barrier=false")],
    ),
    (
        {**ROE, "num_moe_token_chunks": 2, "moe_chunk_pipeline": True, "num_moe_emb_chunks": 2},
        [("moe_chunk_pipeline", "requires num_moe_emb_chunks=0")],
    ),
    (
        {"moe_chunk_pipeline": True},
        [
            ("moe_chunk_pipeline", "requires num_moe_token_chunks > 1 (set it false at one chunk)"),
            ("moe_chunk_pipeline", "requires use_ring_of_experts=true"),
        ],
    ),
    # at one chunk the pipeline is off, and the packed routing gather must be off with it
    (
        {
            **ROE,
            "num_moe_token_chunks": 1,
            "moe_chunk_pipeline": False,
            "moe_roe_packed_routing_gather": True,
        },
        [("moe_roe_packed_routing_gather", "requires moe_chunk_pipeline=true")],
    ),
    (
        {
            **ROE,
            "num_moe_token_chunks": 1,
            "moe_chunk_pipeline": False,
            "moe_roe_packed_routing_gather": False,
        },
        [],
    ),
    (
        {"ring_of_experts_local_routing": True},
        [("ring_of_experts_local_routing", "requires use_ring_of_experts=true")],
    ),
    (
        {"ring_of_experts_row_major_reduce_scatter": "true"},
        [("ring_of_experts_row_major_reduce_scatter", "requires use_ring_of_experts=true")],
    ),
    (
        {"use_ring_of_experts": True, "ragged_buffer_factor": 2.0},
        [("ragged_buffer_factor", "> 0 with use_ring_of_experts requires use_ragged_sort=true")],
    ),
    ({"use_ring_of_experts": True, "ragged_buffer_factor": -1}, []),
    ({"moe_expert_weight_prefetch": "forward"}, []),
    ({"moe_expert_weight_prefetch": "none"}, []),
    (
        {"moe_expert_weight_prefetch": "backward"},
        [("moe_expert_weight_prefetch", "must be none, forward or forward_backward, not 'backward'")],
    ),
    (
        {"moe_expert_weight_prefetch": "forward", "sparse_matmul": False},
        [("moe_expert_weight_prefetch", "requires sparse_matmul=true")],
    ),
    (
        {"use_tokamax_splash": True, "use_jax_splash": True},
        [("use_jax_splash", "at most one of use_tokamax_splash and use_jax_splash can be true")],
    ),
    ({"num_vocab_tiling": 16}, []),
    ({"num_vocab_tiling": 16, "per_device_batch_size": 0.25, "max_target_length": 64}, []),  # 16 tokens
    (
        {"num_vocab_tiling": 2, "per_device_batch_size": 0.125, "max_target_length": 100},
        [
            (
                "num_vocab_tiling",
                "per_device_batch_size x max_target_length = 12.5 is not divisible by num_vocab_tiling 2",
            )
        ],
    ),
    (
        {"num_vocab_tiling": 16, "per_device_batch_size": 0.125, "max_target_length": 100},
        [
            (
                "num_vocab_tiling",
                "per_device_batch_size x max_target_length = 12.5 is not divisible by num_vocab_tiling 16",
            )
        ],
    ),
    (
        {"ici_context_parallelism": 8, "context_parallel_strategy": "ring", "max_target_length": 65536 + 32},
        [
            (
                "context_parallel_strategy",
                "ring context parallelism 8 needs max_target_length % 64 == 0, max_target_length is 65568",
            )
        ],
    ),
    (
        {"ici_context_parallelism": 8, "context_parallel_strategy": "all_gather", "max_target_length": 65568},
        [],
    ),
    ({"ici_context_parallelism": 8, "context_parallel_strategy": "ulysses", "max_target_length": 65568}, []),
    # the ring spans the slices too: ici x dcn context ranks
    (
        {
            "ici_context_parallelism": 2,
            "dcn_context_parallelism": 2,
            "context_parallel_strategy": "ring",
            "max_target_length": 65544,
        },
        [
            (
                "context_parallel_strategy",
                "ring context parallelism 4 needs max_target_length % 16 == 0, max_target_length is 65544",
            )
        ],
    ),
    # MaxText's rules fire above one chunk and above a zero buffer factor, as rljob's
    ({"num_moe_token_chunks": 0}, []),
    (
        {**ROE, "num_moe_token_chunks": 0, "moe_chunk_pipeline": True},
        [("moe_chunk_pipeline", "requires num_moe_token_chunks > 1 (set it false at one chunk)")],
    ),
    # numbers written as strings count
    ({"num_moe_token_chunks": "2"}, [("num_moe_token_chunks", "2 chunks require use_ring_of_experts=true")]),
    (
        {"ici_context_parallelism": 2, "context_parallel_strategy": "ring", "max_target_length": 65538},
        [
            (
                "context_parallel_strategy",
                "ring context parallelism 2 needs max_target_length % 4 == 0, max_target_length is 65538",
            )
        ],
    ),
    # load-balanced context parallelism (MaxText's default): 2 x context equal chunks a row
    *[
        (
            {"ici_context_parallelism": cp, "max_target_length": target, **extra},
            [
                (
                    "context_parallel_load_balance",
                    f"load-balanced context parallelism {cp} needs an even context axis and a token "
                    f"budget (max_target_length, spec.packing.tokenBudget) divisible by {2 * cp}, it is "
                    f"{target}; set context_parallel_load_balance=false or change the context axis",
                )
            ]
            if bad
            else [],
        )
        for cp, target, extra, bad in [
            (2, 4096, {}, False),
            (4, 4100, {}, True),
            (3, 4098, {}, True),
            (4, 4100, {"context_parallel_load_balance": False}, False),
            (1, 4097, {}, False),
        ]
    ],
    ({"use_ring_of_experts": True, "ragged_buffer_factor": 0}, []),
    # a value that is not a number counts as 0: no numeric rule fires (MaxText's type check reports it)
    ({"use_ring_of_experts": True, "ragged_buffer_factor": "auto"}, []),
    ({**ROE, "num_moe_token_chunks": 2, "moe_chunk_pipeline": True, "num_moe_emb_chunks": "auto"}, []),
    (
        {"model_name": "qwen3-8b", "base_num_kv_heads": 4},
        [
            (
                "base_num_kv_heads",
                "the qwen3-8b model config sets base_num_kv_heads=8; MaxText refuses another value unless "
                "override_model_config=true",
            )
        ],
    ),
    ({"model_name": "qwen3-8b", "base_num_kv_heads": 4, "override_model_config": True}, []),
    ({"model_name": "qwen3-8b", "base_num_kv_heads": 8}, []),
    (
        {"model_name": "qwen3-8b", "vocab_size": 1000},
        [
            (
                "vocab_size",
                "the qwen3-8b model config sets vocab_size=151936; MaxText refuses another value unless "
                "override_model_config=true",
            )
        ],
    ),
]


@pytest.mark.parametrize(("keys", "problems"), RULES)
def test_rules(keys: dict[str, Any], problems: list[tuple[str, str]]) -> None:
    assert maxtext_keys.check_rules({**OK_BASE, **keys}, NEWER) == problems


def test_rules_about_undefined_keys_never_fire_at_025() -> None:
    ks = maxtext_keys.load("0.2.5")
    assert maxtext_keys.check_rules({**OK_BASE, "moe_roe_packed_routing_gather": True}, ks) == []


def test_rules_need_their_keys_in_the_version() -> None:
    """A version without the chunk keys (or without max_target_length) checks no chunk rule."""
    no_chunks = maxtext_keys.KeySet(version="old", defaults={"use_ring_of_experts": False}, models={})
    assert maxtext_keys.check_rules({}, no_chunks) == []
    no_target = maxtext_keys.KeySet(
        version="old", defaults={"use_ring_of_experts": False, "num_moe_token_chunks": 1}, models={}
    )
    assert maxtext_keys.check_rules({"use_ring_of_experts": True, "num_moe_token_chunks": 3}, no_target) == []


def test_key_sets_are_immutable() -> None:
    """load() caches one KeySet per version, shared by every resolve: nothing may change it."""
    ks = maxtext_keys.load("0.2.5")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ks.version = "0.2.6"  # type: ignore[misc]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", float("inf"), 1e400, "1e999"])
def test_non_finite_numbers_fire_no_rule_and_never_crash(value: object) -> None:
    """int(float('inf')) raised OverflowError inside the webhook; a value that is no finite number now
    counts as no number (MaxText itself refuses it at start, naming the key)."""
    from rljob.recipes import maxtext_keys

    keyset = maxtext_keys.load("0.2.5")
    keys = {"num_moe_token_chunks": value, "num_vocab_tiling": value, "max_target_length": 4096}
    assert maxtext_keys.check_rules(keys, keyset) == []


def test_custom_mesh_axes_are_maxtexts() -> None:
    from importlib import resources

    import maxtext  # noqa: F401  (pinned in the trainer extra: its absence fails)
    import yaml

    folder = resources.files("maxtext").joinpath("configs", "custom_mesh_and_rule")
    got = {
        p.name.removesuffix(".yml"): tuple(yaml.safe_load(p.read_text(encoding="utf-8"))["mesh_axes"])
        for p in folder.iterdir()
        if p.name.endswith(".yml")
    }
    assert got == maxtext_keys.CUSTOM_MESH_AXES


@pytest.mark.parametrize(
    ("keys", "problems"),
    [
        ({"custom_mesh_and_rule": "cp-as-ep", "ici_context_parallelism": 4, "ici_expert_parallelism": 2}, []),
        (
            {"custom_mesh_and_rule": "cp-as-ep", "ici_tensor_parallelism": 2, "ici_context_parallelism": 4},
            [
                (
                    "custom_mesh_and_rule",
                    "cp-as-ep builds the mesh over data, stage, fsdp, context, expert only: "
                    "spec.trainer.mesh.tensor 2 would leave devices out (MaxText refuses the mesh at start); "
                    "set spec.trainer.mesh.tensor to 1 or use another rule",
                )
            ],
        ),
        (
            {"custom_mesh_and_rule": "pure-fsdp", "ici_fsdp_parallelism": 4, "dcn_data_parallelism": 2},
            [
                (
                    "custom_mesh_and_rule",
                    "pure-fsdp builds the mesh over fsdp only: spec.trainer.mesh.data 2 would leave devices "
                    "out (MaxText refuses the mesh at start); set spec.trainer.mesh.data to 1 or use another "
                    "rule",
                )
            ],
        ),
    ],
)
def test_a_custom_mesh_rule_keeps_only_its_axes(
    keys: dict[str, Any], problems: list[tuple[str, str]]
) -> None:
    assert maxtext_keys.check_rules({**OK_BASE, **keys}, maxtext_keys.load("0.2.5")) == problems


def test_gated_delta_net_context_parallelism_needs_load_balance_off() -> None:
    ks = maxtext_keys.load("0.2.5")
    keys = {**OK_BASE, "model_name": "qwen3.5-397b-a17b", "ici_context_parallelism": 2}
    assert [k for k, _ in maxtext_keys.check_rules(keys, ks)] == ["context_parallel_load_balance"]
    assert maxtext_keys.check_rules({**keys, "context_parallel_load_balance": False}, ks) == []
    assert maxtext_keys.check_rules({**keys, "ici_context_parallelism": 1}, ks) == []
    assert maxtext_keys.check_rules({**keys, "model_name": "qwen3-8b"}, ks) == []
