"""Why the policy reorders its rows under context parallelism (rljob.trainer.model.Policy.hidden_states).

MaxText's load-balanced context parallelism (``context_parallel_load_balance``, true by default) expects the
batch in DUAL_CHUNK_SWAP order: a row cut in 2 x cp chunks, context rank r holding chunks r and 2cp-1-r.
MaxText's own input pipeline reorders every batch so (``max_utils.reorder_causal_load_balanced``); its TPU
Splash kernel bakes the order into a static mask (``LoadBalancedCausalMask``: query i is token
``q_sequence[i]`` of the row) and puts keys and values back in row order before the kernel. A trainer that
hands the model rows in their own order gets a causal mask over the wrong positions: tokens that see the
future and miss their past, with no error. The CPU's dot-product attention masks by the tokens' positions,
so a CPU run cannot show this; the mask itself can.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.jax


@pytest.mark.parametrize(("cp", "length"), [(2, 16), (4, 32), (2, 24)])
def test_the_load_balanced_splash_mask_is_causal_only_in_the_order_the_policy_feeds(
    cp: int, length: int
) -> None:
    import jax.numpy as jnp
    from maxtext.layers.attention_op import LoadBalancedCausalMask
    from maxtext.utils.max_utils import reorder_sequence

    mask = np.asarray(LoadBalancedCausalMask(shape=(length, length), cp_size=cp)[:, :])
    order = np.asarray(reorder_sequence(jnp.arange(length)[None, :], cp))[0]  # what the policy feeds
    keys = np.arange(length)  # keys and values: back in the row's order inside MaxText's kernel wrapper
    # In the fed order, query i is token order[i]: the mask is causal over the true positions.
    assert np.array_equal(mask, order[:, None] >= keys[None, :])
    # Rows in their own order would be masked as if they were reordered: wrong for many pairs.
    wrong = mask != (keys[:, None] >= keys[None, :])
    assert wrong.sum() >= length, wrong.sum()
    # The order is a permutation, and the policy's way back restores the row.
    assert sorted(order) == list(range(length))
    back = np.asarray(reorder_sequence(jnp.asarray(order)[None, :], cp, to_contiguous=True))[0]
    assert np.array_equal(back, keys)
