"""spec.algorithm's loop options by their effect: GSPO's sequence-level ratio, DAPO's clip-higher, token-
versus sequence-level normalization, overlong shaping, and the sampling parameters of the CPU sampler
(top-k, top-p, stop strings) as vLLM's TPU backend applies them."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rljob.trainer.losses import LossConfig, overlong_penalty, policy_loss, sequence_log_ratio
from rljob.trainer.packing import PackConfig, pack_rollouts
from rljob.trainer.rollouts import Batch, grpo_rollouts
from rljob.trainer.sampler_client import Completion, Sampling
from rljob.trainer.tinypolicy import filter_logits
from rljob.trainer.train_step import stack_micro_batches

TESTED_MODULES = (
    "rljob.trainer.evaluation",
    "rljob.trainer.warmstart",
    "rljob.trainer.tinypolicy",
)

# ----------------------------------------------------------------------------------------- GSPO


def test_sequence_ratio_is_the_exp_of_each_sequences_mean_token_log_ratio() -> None:
    """Two packed rows, three sequences (row 0: segments 1 and 2; row 1: segment 1, then padding): every
    live token of a sequence gets exp(mean of that sequence's token log-ratios); prompt tokens (weight 0)
    do not count in the mean."""
    lp = jnp.array([[0.0, -1.0, -2.0, 0.0, -0.5, -0.1], [0.0, -0.3, -0.9, -0.6, 0.0, 0.0]])
    old = jnp.array([[0.0, -1.2, -1.5, 0.0, -0.2, -0.4], [0.0, -0.3, -0.3, -0.3, 0.0, 0.0]])
    seg = jnp.array([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 0, 0]])
    live = jnp.array([[0, 1, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0]], bool)  # position 0 of each: prompt
    got = np.asarray(sequence_log_ratio(lp - old, live, seg))
    s1 = np.mean([0.2, -0.5])  # row 0 segment 1: tokens 1, 2
    s2 = np.mean([-0.3, 0.3])  # row 0 segment 2: tokens 4, 5
    s3 = np.mean([0.0, -0.6, -0.3])  # row 1 segment 1: tokens 1..3
    np.testing.assert_allclose(got[0, 1:3], [s1, s1], atol=1e-6)
    np.testing.assert_allclose(got[0, 4:6], [s2, s2], atol=1e-6)
    np.testing.assert_allclose(got[1, 1:4], [s3] * 3, atol=1e-6)

    # The loss uses it: importance sampling with sequence weights is -(1/N) sum_i exp(s_i) A_i.
    adv = jnp.array([[0.0, 1.0, 1.0, 0.0, -2.0, -2.0], [0.0, 0.5, 0.5, 0.5, 0.0, 0.0]])
    w = live * jnp.array([[0, 1 / 2, 1 / 2, 0, 1 / 2, 1 / 2], [0, 1 / 3, 1 / 3, 1 / 3, 0, 0]]) / 3
    loss, _metrics = policy_loss(lp, old, adv, w, LossConfig(ratio="sequence"), segments=seg)
    want = -(np.exp(s1) * 1.0 + np.exp(s2) * -2.0 + np.exp(s3) * 0.5) / 3
    assert float(loss) == pytest.approx(want, rel=1e-5)
    token_loss, _ = policy_loss(lp, old, adv, w, LossConfig(ratio="token"), segments=seg)
    assert abs(float(token_loss) - want) > 1e-3  # the token-level ratio is another loss

    # Its gradient reaches every token of a sequence equally: d loss / d lp_t = -exp(s_i) A_i / (N |y_i|).
    grad = np.asarray(
        jax.grad(lambda x: policy_loss(x, old, adv, w, LossConfig(ratio="sequence"), segments=seg)[0])(lp)
    )
    np.testing.assert_allclose(grad[0, 1:3], [-np.exp(s1) / 6] * 2, rtol=1e-5)
    np.testing.assert_allclose(grad[1, 1:4], [-np.exp(s3) * 0.5 / 9] * 3, rtol=1e-5)
    assert grad[0, 0] == 0 and grad[1, 4] == 0


def test_a_sequence_ratio_without_segments_is_refused() -> None:
    with pytest.raises(ValueError, match="segment ids"):
        policy_loss(jnp.zeros(3), jnp.zeros(3), jnp.ones(3), jnp.ones(3), LossConfig(ratio="sequence"))


# ----------------------------------------------------------------------------------- clip-higher


def _grad_at(ratio: float, advantage: float, cfg: LossConfig) -> float:
    """d loss / d logprob of one token whose ratio to the sampler's is ``ratio``."""
    old = jnp.array([-1.0])
    return float(
        jax.grad(lambda lp: policy_loss(lp, old, jnp.array([advantage]), jnp.array([1.0]), cfg)[0])(
            old + np.log(ratio)
        )[0]
    )


@pytest.mark.parametrize(
    ("ratio", "advantage", "clip_high", "moves"),
    [
        (1.25, 1.0, 0.2, False),  # symmetric PPO: above 1.2 a positive advantage no longer pushes
        (1.25, 1.0, 0.28, True),  # clip-higher: it may rise to 1.28 ...
        (1.27, 1.0, 0.28, True),
        (1.30, 1.0, 0.28, False),  # ... and not beyond
        (0.75, -1.0, 0.28, False),  # the lower bound 1 - clipLow (0.8) stays for a negative advantage
        (0.85, -1.0, 0.28, True),
    ],
)
def test_clip_higher_lets_a_positive_advantage_ratio_rise_to_one_plus_eps_high_and_not_beyond(
    ratio: float, advantage: float, clip_high: float, moves: bool
) -> None:
    g = _grad_at(ratio, advantage, LossConfig(kind="ppo", clip_low=0.2, clip_high=clip_high))
    assert (g != 0) == moves, g
    if moves:
        assert g == pytest.approx(-ratio * advantage, rel=1e-5)  # d(-r A)/d lp = -r A


# ------------------------------------------------------------------------------ normalization


def _batch(lengths: list[int], rewards: list[float]) -> Batch:
    comps = [
        Completion(prompt_index=i // 2, tokens=[5] * n, logprobs=[-1.0] * n, text="", adapter="x-v0")
        for i, n in enumerate(lengths)
    ]
    prompts: Any = [type("P", (), {"tokens": [1, 2], "text": None})() for _ in range(len(lengths) // 2)]
    return Batch(0, prompts, comps, np.asarray(rewards, np.float32), 0.0)


@pytest.mark.parametrize(("mode", "share_of_long"), [("token", 8 / 10), ("sequence", 1 / 2)])
def test_token_level_normalization_weights_a_long_completion_more_than_sequence_mean(
    mode: str, share_of_long: float
) -> None:
    """One group of two completions, 2 and 8 tokens, rewards 1 and 0: the step's loss weights as the train
    step stacks them. Token level: each token 1/10, so the long completion holds 8/10 of the weight;
    sequence mean: each completion 1/2 whatever its length."""
    rollouts, skipped = grpo_rollouts(_batch([2, 8], [1.0, 0.0]), 2, loss_normalization=mode)  # type: ignore[arg-type]
    assert skipped == 0
    packed = pack_rollouts(rollouts, PackConfig(budget=16, rows=2, segment_align=1))
    (call,) = stack_micro_batches(packed, 1)
    w, seg = call["weights"][0], call["segment_ids"][0]
    lengths = {s: int((call["tokens"][0][seg == s] != 0).sum()) for s in np.unique(seg[seg > 0])}
    by_len = {lengths[s]: float(w[seg == s].sum()) for s in lengths}
    long = max(v for k, v in by_len.items() if k >= 8)
    assert long == pytest.approx(share_of_long, rel=1e-5)
    assert float(w.sum()) == pytest.approx(1.0, rel=1e-5)


# --------------------------------------------------------------------------------- overlong


def test_overlong_shaping_penalises_completions_past_the_threshold_linearly() -> None:
    got = overlong_penalty([0, 6, 7, 8, 9, 10, 12], max_tokens=10, buffer=4, penalty=0.5)
    np.testing.assert_allclose(got, [0, 0, -0.125, -0.25, -0.375, -0.5, -0.5])
    np.testing.assert_array_equal(overlong_penalty([10, 3], 10, 0), [0, 0])  # buffer 0: off
    with pytest.raises(ValueError, match="overlongBuffer"):
        overlong_penalty([1], 4, 5)


# ---------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize(
    ("top_k", "top_p", "kept"),
    [
        (0, 1.0, [0, 1, 2, 3]),  # both off
        (1, 1.0, [0]),  # top-k 1: the largest only
        (2, 1.0, [0, 1]),
        (0, 0.5, [0]),  # probabilities .5, .25, .15, .1: 0.5 is reached by the first
        (0, 0.7, [0, 1]),
        (0, 0.76, [0, 1, 2]),
        (3, 0.7, [0, 1]),  # top-k, then top-p over what is left
    ],
)
def test_top_k_then_top_p_keep_the_tokens_vllm_keeps(top_k: int, top_p: float, kept: list[int]) -> None:
    z = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1]]))
    out = np.asarray(filter_logits(z, jnp.int32(top_k), jnp.float32(top_p)))[0]
    assert [i for i in range(4) if np.isfinite(out[i])] == kept


def test_the_request_body_carries_only_parameters_that_are_on() -> None:
    assert Sampling().body() == {"temperature": 1.0}
    assert Sampling(0.7, 0.9, 20, ("\n\n",)).body() == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "stop": ["\n\n"],
    }


@pytest.fixture(scope="module")
def byte_policy() -> Any:
    """The tiny model with a 256-token vocabulary: the CPU sampler's byte tokenizer fits it."""
    from rljob.trainer.model import ModelSpec, Policy, tiny_keys

    return Policy(ModelSpec(maxtext=tiny_keys(vocab_size=256, max_target_length=64), lora_rank=8))


def _complete(url: str, **body: Any) -> list[dict[str, Any]]:
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps({"prompt": [[1, 2, 3]], "max_tokens": 24, "return_token_ids": True, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        out: list[dict[str, Any]] = json.loads(r.read())["choices"]
        return out


@pytest.mark.jax
def test_cpu_sampler_top_k_1_is_greedy_and_a_stop_string_truncates_at_it(byte_policy: Any) -> None:
    from fixtures.cpu_sampler import serve_cpu_sampler

    with serve_cpu_sampler(byte_policy) as (url, _):
        greedy = _complete(url, temperature=0.0)[0]["token_ids"]
        free = [c["token_ids"] for c in _complete(url, temperature=1.0, n=4)]
        assert any(ids != greedy for ids in free)  # temperature 1 alone varies
        top1 = [c["token_ids"] for c in _complete(url, temperature=1.0, n=4, top_k=1)]
        assert top1 == [greedy] * 4  # top-k 1: greedy and deterministic

        # A stop string: the first printable ASCII byte of the greedy completion (one byte, one token).
        at = next((k for k, b in enumerate(greedy) if 32 <= b < 127), None)
        if at is None:
            pytest.skip("the greedy completion has no printable ASCII byte")  # pragma: no cover
        stop = chr(greedy[at])
        (cut,) = _complete(url, temperature=0.0, stop=[stop])
        assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
        assert cut["token_ids"] == greedy[: at + 1]  # the tokens keep the one that completed the string
        assert cut["text"] == bytes(greedy[:at]).decode(errors="replace")  # the text leaves it out


# -------------------------------------------------------------------------------- evaluation


@pytest.mark.parametrize(
    ("n", "c", "k", "want"),
    [
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (10, 3, 1, 0.3),  # pass@1 is the share correct
        (4, 1, 2, 1 - (3 * 2) / (4 * 3)),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 3, 1 - 1 / 10),  # C(3,3)/C(5,3) = 1/10
        (5, 3, 3, 1.0),  # n - c < k: every k-subset holds a correct sample
        (200, 7, 100, 1 - __import__("math").comb(193, 100) / __import__("math").comb(200, 100)),
    ],
)
def test_pass_at_k_is_the_codex_unbiased_estimator(n: int, c: int, k: int, want: float) -> None:
    from rljob.trainer.evaluation import pass_at_k

    assert pass_at_k(n, c, k) == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_scores_pass_and_majority() -> None:
    """Two prompts, 4 samples each. Prompt A: one correct sample whose answer is in the minority; prompt
    B: the majority answer is the correct one."""
    from rljob.trainer.evaluation import EvalOptions, scores

    a = [(0.0, "3"), (1.0, "4"), (0.0, "3"), (0.0, "5")]
    b = [(1.0, "7"), (0.0, "1"), (1.0, "7"), (0.0, None)]
    got = scores(EvalOptions(pass_k=2, maj_k=4, samples=4), [a, b])
    assert got["eval_pass_at_k"] == pytest.approx((0.5 + (1 - 1 / 6)) / 2)
    assert got["eval_maj_at_k"] == 0.5  # A's majority "3" is wrong, B's "7" right
    assert got["eval_reward"] == pytest.approx(3 / 8)
    assert (got["eval_pass_k"], got["eval_maj_k"]) == (2, 4)


# -------------------------------------------------------------------------------- warm start


@pytest.mark.jax
def test_warm_start_loads_an_exported_adapter_into_the_train_state(cpu_policy: Any, tmp_path: Any) -> None:
    """export -> spec.lora.initFrom -> the trainer's initial LoRA state: identical parameters, so adapter
    v0 (published from that state) is the adapter it started from; another rank is refused by name."""
    from rljob.trainer.train_step import StepConfig, Trainer
    from rljob.trainer.warmstart import load_adapter

    keys = iter(jax.random.split(jax.random.key(3), 64))
    lora = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype), cpu_policy.lora0)
    cpu_policy.peft.save(lora, tmp_path / "v7")
    state = Trainer(cpu_policy, StepConfig(budget=64)).init_state(
        load_adapter(str(tmp_path / "v7"), cpu_policy.peft)
    )
    for got, want in zip(jax.tree.leaves(state.lora), jax.tree.leaves(lora), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(state.lora))  # not the zero adapter
    again = cpu_policy.peft.to_peft(state.lora)
    assert set(again) == set(cpu_policy.peft.to_peft(lora))

    cfg = json.loads((tmp_path / "v7" / "adapter_config.json").read_text())
    (tmp_path / "r4").mkdir()
    (tmp_path / "r4" / "adapter_config.json").write_text(json.dumps({**cfg, "r": 4}))
    (tmp_path / "r4" / "adapter_model.safetensors").write_bytes(
        (tmp_path / "v7" / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(ValueError, match=r"spec.lora.initFrom: .*/r4: the adapter's r is 4, this run's 8"):
        load_adapter(str(tmp_path / "r4"), cpu_policy.peft)
    with pytest.raises(
        ValueError, match=r"spec.lora.initFrom: .*/none: no adapter_config.json, adapter_model"
    ):
        load_adapter(str(tmp_path / "none"), cpu_policy.peft)


# --------------------------------------------------------------------- environment tokens (masks)


def test_the_loss_ignores_tokens_the_completion_mask_leaves_out() -> None:
    """A two-turn rollout: model tokens, two environment tokens (completion_mask 0), model tokens again.
    Packed, the environment's tokens have weight 0: the loss and its gradient do not depend on their
    log-probs, their sampler log-probs (even NaN) or their advantage."""
    from rljob.trainer.packing import Rollout

    mask = np.array([1, 1, 0, 0, 1], np.float32)

    def step(env_old: float, env_lp: float) -> tuple[float, np.ndarray]:
        r = Rollout(
            prompt_ids=np.array([1, 2], np.int32),
            completion_ids=np.array([3, 4, 9, 9, 5], np.int32),
            advantage=1.0,
            completion_mask=mask,
            per_token={"old_logprobs": np.array([-1.0, -0.5, env_old, env_old, -0.7], np.float32)},
        )
        (call,) = stack_micro_batches(pack_rollouts([r], PackConfig(budget=8, rows=1, segment_align=1)), 1)
        env = (call["segment_ids"][0] > 0) & (call["tokens"][0] == 9)
        lp = jnp.where(env, env_lp, jnp.asarray(call["old_logprobs"][0]) + 0.1)
        old, adv, w = (jnp.asarray(call[k][0]) for k in ("old_logprobs", "advantages", "weights"))
        assert float(w[env].sum()) == 0 and float(w.sum()) == pytest.approx(1.0)
        cfg = LossConfig(kind="ppo")
        loss, grad = jax.value_and_grad(lambda x: policy_loss(x, old, adv, w, cfg)[0])(lp)
        assert np.all(np.asarray(grad)[np.asarray(env)] == 0)
        return float(loss), np.asarray(grad)

    base_loss, base_grad = step(-2.0, -3.0)
    for env_old, env_lp in ((float("nan"), -3.0), (-9.0, 0.0), (-0.1, -20.0)):
        loss, grad = step(env_old, env_lp)
        assert loss == base_loss
        np.testing.assert_array_equal(grad, base_grad)
