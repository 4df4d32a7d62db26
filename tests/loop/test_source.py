"""The loop's rollout source against a live CPU sampler: grading, GRPO advantages, pipelining with a
policy lag of at most one, evaluation, and the step-0 parity gate (including a broken variant it refuses)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from rljob.common.ports import free_port
from rljob.sampler.adapters import AdapterStore, AdapterWatcher, LoraEndpoint
from rljob.trainer.data import Prompt, SuccessorTask
from rljob.trainer.evaluation import EvalOptions
from rljob.trainer.export import publish_adapter
from rljob.trainer.packing import PackConfig
from rljob.trainer.rollouts import Batch, ParityError, SamplerSource, grpo_rollouts
from rljob.trainer.sampler_client import Completion, SamplerClient, SamplerClosed

TESTED_MODULES = (
    "rljob.trainer.rollouts",
    "rljob.trainer.sampler_client",
)

pytestmark = pytest.mark.jax


def _setup(uri: str, url: str, policy: Any, tmp_path: Path) -> AdapterWatcher:
    publish_adapter(uri, 0, policy.peft.to_peft(policy.lora0), policy.peft.config())
    watcher = AdapterWatcher(AdapterStore(uri), LoraEndpoint(url), tmp_path / "local", "job")
    assert watcher.poll_once() is not None
    return watcher


def _source(url: str, policy: Any, **kw: Any) -> SamplerSource:
    lines: list[dict[str, Any]] = []
    src = SamplerSource(
        SamplerClient([url], "job"),
        SuccessorTask(),
        steps=4,
        group_size=4,
        groups_per_batch=3,
        logprobs=jax.jit(policy.next_token_logprobs),
        emit=lines.append,
        **kw,
    )
    src.lines = lines  # type: ignore[attr-defined]
    return src


def test_source_grades_pipelines_and_passes_parity(
    gcs_bucket: str, cpu_sampler: tuple[str, Any], cpu_policy: Any, tmp_path: Path
) -> None:
    url, _ = cpu_sampler
    uri = f"{gcs_bucket}/adapters"
    watcher = _setup(uri, url, cpu_policy, tmp_path)
    # The parity gate scores the 12 rollouts packed several to a row, in one [2, 64] shape.
    src = _source(
        url, cpu_policy, evaluation=EvalOptions(every=2), pack=PackConfig(budget=64, rows=2, segment_align=1)
    )
    try:
        rollouts, m = src(0, cpu_policy.lora0)
        assert src.parity_shapes == {(2, 64)}
        # groups whose 4 rewards are all equal are left out (an untrained model is mostly wrong)
        assert len(rollouts) == 4 * (3 - m["groups_skipped"])
        assert m["policy_lag"] == 0 and m["sampled_with"] == 0
        assert "eval_reward" in m and 0.0 <= m["eval_reward"] <= 1.0
        parity = src.lines[0]  # type: ignore[attr-defined]
        assert parity["event"] == "parity" and parity["mean_abs_logprob_diff"] < 1e-4
        for r in rollouts:
            assert len(r.completion_ids) == 1 and len(r.per_token["old_logprobs"]) == 1  # type: ignore[arg-type]
        adv = np.asarray([r.advantage for r in rollouts]).reshape(-1, 4)
        np.testing.assert_allclose(adv.sum(axis=1), 0.0, atol=1e-5)  # GRPO: centred per group
        assert 1 in src.pending  # step 1 is already being sampled while step 0 trains

        # The trainer publishes v1 after step 0; step 1 was sampled with v0 (lag 1), step 2 with >= v1.
        publish_adapter(uri, 1, cpu_policy.peft.to_peft(cpu_policy.lora0), cpu_policy.peft.config())
        _, m1 = src(1, cpu_policy.lora0)
        assert m1["policy_lag"] == 1 and m1["sampled_with"] == 0
        watcher.poll_once()
        _, m2 = src(2, cpu_policy.lora0)
        assert m2["policy_lag"] <= 1 and m2["sampled_with"] >= 1
        # Step 3 is now waiting for v2, which nobody publishes: close() must end that wait (a trainer that
        # fails mid-run must exit, not hang in its sampling thread at interpreter exit).
        waiting = src.pending[3]
    finally:
        src.close()
    with pytest.raises(SamplerClosed):
        waiting.result(timeout=5)


def test_parity_gate_refuses_different_weights(
    gcs_bucket: str, cpu_sampler: tuple[str, Any], cpu_policy: Any, tmp_path: Path
) -> None:
    """Broken variant: the trainer's adapter differs from the served v0; the gate must refuse."""
    url, _ = cpu_sampler
    _setup(f"{gcs_bucket}/adapters", url, cpu_policy, tmp_path)
    rng = np.random.default_rng(0)
    peft = {
        k: v + 0.5 * rng.standard_normal(v.shape).astype(np.float32)
        for k, v in cpu_policy.peft.to_peft(cpu_policy.lora0).items()
    }
    other = cpu_policy.peft.from_peft(peft)
    src = _source(url, cpu_policy)
    try:
        with pytest.raises(ParityError, match="refusing to train"):
            src(0, other)
        assert src.lines[0]["mean_abs_logprob_diff"] > 1e-3  # type: ignore[attr-defined]
    finally:
        src.close()


def test_close_ends_a_wait_for_an_unreachable_sampler() -> None:
    """No sampler listens on the port: the client waits (never fatal) until close(), then raises."""
    import threading

    port = free_port()
    client = SamplerClient([f"http://127.0.0.1:{port}"], "job", timeout=1.0, retry_s=0.05)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            client.wait_version(client.urls[0], 0)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive(), "the client gave up on a sampler that may still come up"
    client.close()
    t.join(3)
    assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], SamplerClosed)


@pytest.fixture(scope="module")
def byte_policy() -> Any:
    """The tiny model with a 256-token vocabulary: the CPU sampler's byte tokenizer fits it."""
    from rljob.trainer.model import ModelSpec, Policy, tiny_keys

    return Policy(ModelSpec(maxtext=tiny_keys(vocab_size=256, max_target_length=64), lora_rank=8))


def test_text_prompts_train_on_the_samplers_tokens(gcs_bucket: str, byte_policy: Any, tmp_path: Path) -> None:
    """The math task's text prompts: the sampler tokenizes (UTF-8 bytes on the CPU backend) and returns
    prompt_token_ids; the loop trains on exactly those, grades the decoded text with math-verify, and the
    parity gate runs on them too."""
    from fixtures.cpu_sampler import serve_cpu_sampler
    from rljob.trainer.data import MathTask

    cpu_policy = byte_policy
    served = serve_cpu_sampler(cpu_policy)
    url, _ = served.__enter__()
    _setup(f"{gcs_bucket}/adapters", url, cpu_policy, tmp_path)
    rows = "".join(f'{{"question": "{i} + 1 = ?", "answer": "#### {i + 1}"}}\n' for i in range(6))
    task = MathTask.from_jsonl(rows, "mem", template="Q: {question} A:", eval_size=2, max_tokens=3)
    src = SamplerSource(
        SamplerClient([url], "job"),
        task,
        steps=2,
        group_size=2,
        groups_per_batch=3,
        logprobs=jax.jit(cpu_policy.next_token_logprobs),
        evaluation=EvalOptions(every=1),
        emit=lambda rec: None,
    )
    try:
        rollouts, m = src(0, cpu_policy.lora0)
        assert src.parity_checked  # the gate ran on the text prompts' token ids
        assert len(rollouts) == 2 * (3 - m["groups_skipped"])
        # Every group with signal (rewards 1, 0 in each): the rollouts carry the sampler's tokens.
        batch = src.sample(1, 0)
        batch.rewards = np.asarray([1.0, 0.0] * 3, np.float32)
        rollouts, skipped = grpo_rollouts(batch, 2)
        prompts = task.train_prompts(1, 3)
        assert len(rollouts) == 6 and skipped == 0
        for k, r in enumerate(rollouts):
            assert r.prompt_ids.tolist() == list(prompts[k // 2].text.encode())  # type: ignore[union-attr]
            assert len(r.completion_ids) == 3 and len(r.per_token["old_logprobs"]) == 3  # type: ignore[arg-type]
        assert set(np.unique(np.asarray([m["reward_mean"]]))) <= {0.0, 1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0}
        assert 0.0 <= m["eval_reward"] <= 1.0
    finally:
        src.close()
        served.__exit__(None, None, None)


def _graded(rewards: list[float], group_size: int) -> Batch:
    n = len(rewards) // group_size
    prompts = [Prompt(tokens=[10 + g, 20 + g], text=None, answer=[0]) for g in range(n)]
    comps = [
        Completion(
            prompt_index=i // group_size,
            tokens=[i + 1, i + 2],
            logprobs=[-1.0, -2.0],
            text="",
            adapter="j-v0",
        )
        for i in range(len(rewards))
    ]
    return Batch(0, prompts, comps, np.asarray(rewards, np.float32), 0.0, {0})


@pytest.mark.parametrize(
    ("normalization", "want"),
    [
        ("mean", [0.5, -0.5, 0.5, -0.5, -0.25, -0.25, -0.25, 0.75]),
        ("std", [1.0, -1.0, 1.0, -1.0, -1 / np.sqrt(3), -1 / np.sqrt(3), -1 / np.sqrt(3), np.sqrt(3)]),
    ],
)
def test_zero_signal_groups_are_left_out(normalization: str, want: list[float]) -> None:
    """A group whose rewards are all equal (the second) is not trained on: none of its rollouts is returned,
    so it is never packed, run or counted in the step's token mean; the others carry r - mean, or
    (r - mean) / std, per spec.algorithm.advantageNormalization."""
    batch = _graded([1, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0, 1], 4)
    rollouts, skipped = grpo_rollouts(batch, 4, normalization)  # type: ignore[arg-type]
    assert skipped == 1 and len(rollouts) == 8
    assert [r.prompt_ids.tolist() for r in rollouts] == [[10, 20]] * 4 + [[12, 22]] * 4  # type: ignore[union-attr]
    assert [r.completion_ids.tolist()[0] for r in rollouts] == [1, 2, 3, 4, 9, 10, 11, 12]  # type: ignore[union-attr]
    np.testing.assert_allclose([r.advantage for r in rollouts], want, rtol=1e-4)
    # every group without signal: nothing to train on (the trainer's step then makes no update)
    assert grpo_rollouts(_graded([1, 1, 0, 0], 2), 2) == ([], 2)
