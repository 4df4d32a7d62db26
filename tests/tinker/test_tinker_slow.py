"""Longer runs of the Tinker service with the official `tinker` SDK as the client (marked slow):

- a GRPO loop written only against the SDK learns the toy task (the CPU loop's successor task) from chance
  to a mean reward >= 0.9;
- save_state, the service killed (SIGKILL) and started again: a new training client from the saved state
  continues step-exactly, and the old client continues from its automatic checkpoint;
- `make tinker-cpu`'s runner: its printed URL and model serve the SDK (text as byte tokens), SIGINT stops it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.jax, pytest.mark.slow]

import tinker  # noqa: E402
from fixtures.tinker import API_KEY, Served, serve_tinker, tinker_run_config  # noqa: E402
from tinker import types  # noqa: E402


@pytest.fixture(scope="module")
def served(gcs_emulator: Any, cpu_policy: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = f"gs://{gcs_emulator.new_bucket('tinker-slow')}"
    progress = tmp_path_factory.mktemp("tinker-slow") / "progress.json"
    with serve_tinker(lambda port: tinker_run_config(root, port, progress), cpu_policy) as s:
        yield s


@pytest.fixture
def client(served: Served) -> Iterator[Any]:
    """A ServiceClient closed while the service still runs (_close)."""
    c = tinker.ServiceClient(base_url=served.url, api_key=API_KEY)
    try:
        yield c
    finally:
        _close(c)


def _close(client: Any) -> None:
    """End an SDK session before its service stops: an open ServiceClient sends heartbeats from its own
    thread every 10 s and logs their failures long after the service is gone."""
    if client is not None:
        client.close("success").result(timeout=60)


def test_grpo_through_the_sdk_learns_the_toy_task(served: Served, client: Any) -> None:
    from rljob.trainer.data import SuccessorTask

    task = SuccessorTask()
    tc = client.create_lora_training_client(base_model=served.service.cfg.base_model, rank=8, seed=0).result()
    adam = types.AdamParams(learning_rate=4e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    group, groups, rewards = 16, 8, []
    for step in range(200):
        sampler = tc.save_weights_and_get_sampling_client().result()
        prompts = task.train_prompts(step, groups)
        futures = [
            sampler.sample(
                types.ModelInput.from_ints(p.tokens),
                group,
                types.SamplingParams(max_tokens=task.max_tokens, temperature=1.0, seed=step * 1000 + i),
            )
            for i, p in enumerate(prompts)
        ]
        data, step_rewards = [], []
        for p, f in zip(prompts, futures, strict=True):
            seqs = f.result().sequences
            r = [task.reward(p, s.tokens, "") for s in seqs]
            step_rewards += r
            adv = [x - float(np.mean(r)) for x in r]  # GRPO: reward minus the group's mean
            if all(a == 0 for a in adv):
                continue  # no signal in this group
            pad = [0.0] * (len(p.tokens) - 1)
            for s, a in zip(seqs, adv, strict=True):
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(p.tokens + s.tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": p.tokens[1:] + s.tokens,
                            "logprobs": pad + list(s.logprobs),
                            "advantages": pad + [a] * len(s.tokens),
                        },
                    )
                )
        rewards.append(float(np.mean(step_rewards)))
        if len(rewards) >= 3 and np.mean(rewards[-3:]) >= 0.9:
            break
        if data:
            tc.forward_backward(data, "importance_sampling")
            tc.optim_step(adam).result()
    print(json.dumps({"grpo_steps": len(rewards), "rewards": [round(r, 3) for r in rewards]}))
    assert np.mean(rewards[:2]) < 0.3  # chance (1/32), not a pre-trained answer
    assert np.mean(rewards[-3:]) >= 0.9, rewards


# ------------------------------------------------------------------------------------- kill, restart


def _start(cfg: Path, port: int, log: Path) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    from rljob.local.tinker_cpu import service_command

    proc = subprocess.Popen(
        service_command(cfg, port),
        env={**os.environ, "PYTHONSAFEPATH": "1"},
        stdout=subprocess.PIPE,
        stderr=log.open("ab"),
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{") and json.loads(line).get("event") == "serving":
            return proc, json.loads(line)
    raise AssertionError(f"the service exited ({proc.wait()}); see {log}")


def test_save_state_kill_and_continue_step_exactly(gcs_emulator: Any, tmp_path: Path) -> None:
    from rljob.common.ports import free_port
    from rljob.local.tinker_cpu import local_service_config

    root = f"gs://{gcs_emulator.new_bucket('tinker-restart')}"
    rc = local_service_config(root, free_port(span=2), tmp_path / "progress.json", toy=True)
    cfg = tmp_path / "run.json"
    cfg.write_text(rc.model_dump_json())
    port, log = free_port(), tmp_path / "service.log"
    proc, ready = _start(cfg, port, log)
    client = None
    try:
        client = tinker.ServiceClient(base_url=ready["url"], api_key=API_KEY)
        tc = client.create_lora_training_client(base_model=ready["base_model"], rank=8, seed=7).result()
        rng = np.random.default_rng(1)
        batches = []
        for _ in range(4):
            seqs = [[1, *rng.integers(2, 32, 5).tolist()] for _ in range(6)]
            batches.append(
                [
                    types.Datum(
                        model_input=types.ModelInput.from_ints(s[:-1]),
                        loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
                    )
                    for s in seqs
                ]
            )
        probe = [
            types.Datum(
                model_input=types.ModelInput.from_ints([1, 5, 17, 6]),
                loss_fn_inputs={"target_tokens": [5, 17, 6, 9]},
            )
        ]
        adam = types.AdamParams(learning_rate=0.02, beta2=0.999, eps=1e-8)

        def train(c: Any, bs: list[Any]) -> None:
            for b in bs:
                c.forward_backward(b, "cross_entropy")
                c.optim_step(adam).result()

        def lp(c: Any) -> np.ndarray:
            return np.asarray(c.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data)

        train(tc, batches[:2])
        state = tc.save_state("mid").result()
        train(tc, batches[2:])
        want = lp(tc)

        proc.send_signal(signal.SIGKILL)  # no goodbye: a crash or a lost node
        proc.wait(timeout=30)
        proc, ready2 = _start(cfg, port, log)
        assert ready2["restored"] == [tc.model_id]

        # the same training client goes on where it was (its automatic checkpoint after step 4)
        np.testing.assert_array_equal(lp(tc), want)
        # a new client from the state saved after step 2 takes steps 3 and 4 to the same parameters
        tc2 = client.create_training_client_from_state_with_optimizer(state.path).result()
        train(tc2, batches[2:])
        np.testing.assert_array_equal(lp(tc2), want)
        # ... and without the optimizer state it does not (the Adam moments matter)
        tc3 = client.create_training_client_from_state(state.path).result()
        train(tc3, batches[2:])
        assert not np.array_equal(lp(tc3), want)
    finally:
        _close(client)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        time.sleep(0)


def test_make_tinker_cpu_serves_text_until_interrupted(gcs_emulator: Any, tmp_path: Path) -> None:
    """`make tinker-cpu` (rljob.local.tinker_cpu): two processes (the CPU sampler with its adapter agent,
    the service) on the byte-token model; the printed URL and model serve the SDK; SIGINT stops all."""
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "rljob.local.tinker_cpu", "--workdir", str(tmp_path)],
        env={**os.environ, "PYTHONSAFEPATH": "1"},
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "runner.log").open("wb"),
        text=True,
    )
    try:
        assert proc.stdout is not None
        seen: dict[str, str] = {}
        for line in proc.stdout:
            key, _, value = line.strip().partition("=")
            if key in ("TINKER_BASE_URL", "TINKER_BASE_MODEL"):
                seen[key] = value
            if len(seen) == 2:
                break
        assert seen["TINKER_BASE_URL"].startswith("http://127.0.0.1:"), seen
        assert seen["TINKER_BASE_MODEL"] == "rljob/tiny-qwen3"
        client = tinker.ServiceClient(base_url=seen["TINKER_BASE_URL"], api_key="tml-local")
        tc = client.create_lora_training_client(base_model=seen["TINKER_BASE_MODEL"], rank=8, seed=0).result()
        text = list(b"2+2=")  # the tiny model's tokens are UTF-8 bytes
        tc.forward_backward(
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints(text),
                    loss_fn_inputs={"target_tokens": [*text[1:], ord("4")]},
                )
            ],
            "cross_entropy",
        )
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        out = sampler.sample(
            types.ModelInput.from_ints(text), 2, types.SamplingParams(max_tokens=5, seed=1)
        ).result()
        for seq in out.sequences:
            assert len(seq.tokens) == 5 and len(seq.logprobs) == 5 and all(0 <= t < 256 for t in seq.tokens)
            bytes(seq.tokens).decode(errors="replace")
        _close(client)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
