"""The catalog recipes' MaxText dtypes and the 397B recipe's tuned keys, as every render resolves them.

- Every recipe and profile trains with bfloat16 weights and activations (MaxText 0.2.5 defaults
  weight_dtype to float32, twice the HBM for the frozen base; the tunix launcher always passes
  dtype=bfloat16 weight_dtype=bfloat16), optimizer moments and gradients in float32.
- The eight keys of the tuned Qwen3.5-397B TPU7x trainer block that MaxText 0.2.5 defines: each has the
  tuned value, or the recipe file says next to the key why it keeps another (a comment block right above
  the key's line). A key dropped, set to another value without a reason, or a reason deleted fails.
"""

from __future__ import annotations

import pytest
import yaml
from fixtures.recipes import recipe_manifest, resolve
from rljob.recipes import maxtext_keys, recipe_catalog

RECIPE = "qwen3.5-397b-a17b-tpu7x"
# The tuned block's value of each key MaxText 0.2.5 defines.
TUNED = {
    "moe_routing_maps": "device",
    "decoder_layer_input": "device",
    "wi_tile_dlhs_mlp_dim": 2048,
    "wi_tile_fwd_batch_seq": 512,
    "wi_tile_drhs_batch_seq": 512,
    "wo_tile_fwd_batch_seq": 512,
    "wo_tile_dlhs_batch_seq": 512,
    "wo_tile_drhs_batch_seq": 512,
}
# Keys the recipe keeps at another value on purpose (the reason is in the recipe file).
KEPT = {"wi_tile_dlhs_mlp_dim": 1024}


def _cases() -> list[tuple[str, str | None]]:
    return [(n, p) for n in recipe_catalog.names() for p in [None, *recipe_catalog.load(n).profiles]]


@pytest.mark.parametrize(("name", "profile"), _cases())
def test_bfloat16_weights_and_activations(name: str, profile: str | None) -> None:
    keys = resolve(recipe_manifest(name, profile)).trainer.maxtext
    effective = {k: keys.get(k, maxtext_keys.load("0.2.5").defaults[k]) for k in ("dtype", "weight_dtype")}
    assert effective == {"dtype": "bfloat16", "weight_dtype": "bfloat16"}, (name, profile, effective)
    for k in ("grad_dtype", "mu_dtype"):
        assert keys.get(k, "float32") == "float32", (name, profile, k)


def _comment_above(source: str, key: str) -> str:
    """The comment lines directly above ``key:``'s line in the recipe file."""
    lines = source.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{key}:"))
    out = []
    for line in reversed(lines[:at]):
        if not line.strip().startswith("#"):
            break
        out.append(line.strip().lstrip("#").strip())
    return " ".join(reversed(out))


@pytest.mark.parametrize("profile", [None, *recipe_catalog.load(RECIPE).profiles])
def test_tuned_keys_have_the_tuned_value_or_a_reason(profile: str | None) -> None:
    keys = resolve(recipe_manifest(RECIPE, profile)).trainer.maxtext
    defaults = maxtext_keys.load("0.2.5").defaults
    source = recipe_catalog.source(RECIPE)
    recipe_keys = yaml.safe_load(source)["spec"]["trainer"]["maxtext"]
    for key, tuned in TUNED.items():
        assert key in defaults, key  # MaxText 0.2.5 defines it
        got = keys.get(key, defaults[key])
        if key in KEPT:
            assert got == KEPT[key] != tuned, (key, got)
            assert key in recipe_keys, key  # kept explicitly, not by omission
            reason = _comment_above(source, key)
            assert len(reason.split()) >= 15, f"{key}: the recipe keeps {got} without a written reason"
        else:
            assert got == tuned, (key, got, tuned)
    # the tuned block keeps wi's input-gradient row tile at 256 beside its K tile
    assert keys["wi_tile_dlhs_batch_seq"] == 256
