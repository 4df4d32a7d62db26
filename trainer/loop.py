"""The RL loop driver: sample, grade, GRPO advantages, packed training, adapter export, repeat.

One step `s` (the policy after `s` updates is adapter version `v{s}`):
1. take the rollouts of step `s`, sampled by the sampler(s) over HTTP (`/v1/completions` with the
   served adapter, per-token log-probs of the sampled tokens);
2. while training on them, already sample step `s+1`'s rollouts with the newest served version, which is
   at least `v{s}`'s predecessor: the policy lag (trainer step minus sampling version) is at most one
   and is recorded per step;
3. GRPO advantages per group, packed rows (trainer/packing.py), importance-sampling policy loss against
   the sampler's log-probs (trainer/losses.py), one optimizer step;
4. publish adapter `v{s+1}` (PEFT dir + LATEST pointer; the samplers' watchers hot-swap it), checkpoint
   (LoRA + optimizer state + step) so a restarted trainer resumes at exactly the next step;
5. print one JSON line: step, reward_mean, policy_lag, ... ; evaluate held-out prompts every N steps.

Before the first step a parity gate compares the trainer's log-probs of the sampled tokens with the
sampler's on the same weights (adapter v0) and refuses the run (exit 2) above a threshold.

The samplers are found through RunConfig.endpoints.samplers (JobSet DNS names in a cluster, local ports
here); the trainer waits for an unreachable sampler instead of failing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax  # type: ignore[import-untyped]
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage  # type: ignore[import-untyped]
from pydantic import ValidationError
from rljob.recipes.api import ProgressReport
from rljob.recipes.failure import EXIT_BAD_CONFIG
from rljob.recipes.runconfig import CONFIG_ENV, RunConfig
from rljob.trainer.data import Prompt, SuccessorTask, Task
from rljob.trainer.losses import LossConfig, group_advantages, policy_loss
from rljob.trainer.packing import PackConfig, Rollout, pack_rollouts
from rljob.trainer.tinypolicy import TinyPolicy, TinySpec
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

log = logging.getLogger("rljob.trainer.loop")

LATEST = "LATEST"
DEFAULT_PARITY_THRESHOLD = 1e-3  # nats; the seed measured 1.7e-4 on TPU, CPU float32 gives ~1e-6


class LoopConfigError(ValueError):
    """A setting the loop cannot run with; the message names the field."""


# ------------------------------------------------------------------------------------------ storage


def gcs_client() -> storage.Client:
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return storage.Client(
            project=os.environ.get("GOOGLE_CLOUD_PROJECT", "rljob-local"),
            credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
        )
    return storage.Client()


class GcsDir:
    """A gs:// prefix: small objects in and out."""

    def __init__(self, uri: str, client: storage.Client) -> None:
        if not uri.startswith("gs://"):
            raise LoopConfigError(f"storage: {uri!r} is not a gs:// path")
        bucket, _, prefix = uri[5:].partition("/")
        self.uri, self.prefix = uri.rstrip("/"), prefix.strip("/")
        self.bucket = client.bucket(bucket)

    def blob(self, rel: str) -> storage.Blob:
        return self.bucket.blob(f"{self.prefix}/{rel}" if self.prefix else rel)

    def read(self, rel: str) -> bytes | None:
        try:
            return bytes(self.blob(rel).download_as_bytes())
        except gexc.NotFound:
            return None

    def write(self, rel: str, data: bytes) -> None:
        self.blob(rel).upload_from_string(data)

    def upload_dir(self, rel: str, local: Path) -> None:
        for f in sorted(local.rglob("*")):
            if f.is_file():
                self.blob(f"{rel}/{f.relative_to(local)}").upload_from_filename(str(f))


# ------------------------------------------------------------------------------------- the sampler


class SamplerUnavailable(RuntimeError):
    pass


@dataclass
class Completion:
    prompt_index: int
    tokens: list[int]
    logprobs: list[float]
    text: str
    adapter: str


class SamplerClient:
    """OpenAI-style completions against one or more samplers (vLLM or the CPU backend)."""

    def __init__(
        self, urls: list[str], name_prefix: str, timeout: float = 300.0, retry_s: float = 0.05
    ) -> None:
        if not urls:
            raise LoopConfigError("endpoints.samplers: no sampler URL in the run config")
        self.urls = [u.rstrip("/") for u in urls]
        self.prefix = name_prefix
        self.timeout = timeout
        self.retry_s = retry_s
        self.waited_s = 0.0

    def _request(self, url: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return json.loads(resp.read())

    def _retrying(self, fn: Callable[[], Any], what: str) -> Any:
        """Call fn until it succeeds: an unreachable or restarting sampler is waited for, never fatal."""
        warned = False
        t0 = time.monotonic()
        while True:
            try:
                out = fn()
                if warned:
                    log.warning("sampler back after %.1fs (%s)", time.monotonic() - t0, what)
                self.waited_s += time.monotonic() - t0 if warned else 0.0
                return out
            except (urllib.error.URLError, ConnectionError, TimeoutError, SamplerUnavailable, OSError) as e:
                if not warned:
                    log.warning("sampler unavailable (%s): %s; waiting", what, e)
                    warned = True
                time.sleep(self.retry_s)

    def served_version(self, url: str) -> int | None:
        models = self._request(f"{url}/v1/models")
        best: int | None = None
        for m in models.get("data", []):
            mid = str(m.get("id", ""))
            if mid.startswith(self.prefix + "-v") and mid[len(self.prefix) + 2 :].isdigit():
                v = int(mid[len(self.prefix) + 2 :])
                best = v if best is None or v > best else best
        return best

    def wait_version(self, url: str, min_version: int) -> int:
        def check() -> int:
            v = self.served_version(url)
            if v is None or v < min_version:
                raise SamplerUnavailable(f"{url} serves adapter v{v}, waiting for >= v{min_version}")
            return v

        return int(self._retrying(check, f"adapter >= v{min_version}"))

    def complete(
        self, prompts: list[Prompt], n: int, max_tokens: int, temperature: float, seed: int, min_version: int
    ) -> list[Completion]:
        """`n` completions per prompt (prompts split round-robin over the samplers)."""
        out: list[Completion] = []
        shards: dict[int, list[int]] = {}
        for i in range(len(prompts)):
            shards.setdefault(i % len(self.urls), []).append(i)
        for u, idxs in shards.items():
            url = self.urls[u]

            def call(url: str = url, idxs: list[int] = idxs) -> Any:
                version = self.wait_version(url, min_version)
                body: dict[str, Any] = {
                    "model": f"{self.prefix}-v{version}",
                    "prompt": [
                        prompts[i].tokens if prompts[i].tokens is not None else prompts[i].text for i in idxs
                    ],
                    "n": n,
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                    "seed": seed,
                    "logprobs": 0,
                    "return_token_ids": True,
                }
                return self._request(f"{url}/v1/completions", body)

            resp = self._retrying(call, "completions")
            model = str(resp["model"])
            for ch in resp["choices"]:
                k = int(ch["index"])
                lp = ch.get("logprobs") or {}
                out.append(
                    Completion(
                        prompt_index=idxs[k // n],
                        tokens=[int(t) for t in ch["token_ids"]],
                        logprobs=[float(x) for x in lp.get("token_logprobs", [])],
                        text=str(ch.get("text", "")),
                        adapter=model,
                    )
                )
        out.sort(key=lambda c: c.prompt_index)
        return out


def version_of(adapter: str) -> int:
    return int(adapter.rsplit("-v", 1)[1])


# ---------------------------------------------------------------------------------------- settings


@dataclass
class LoopSettings:
    steps: int
    group_size: int
    groups_per_batch: int
    max_tokens: int
    learning_rate: float
    loss: str
    temperature: float = 1.0
    eval_every: int = 10
    checkpoint_every: int = 1
    parity_threshold: float = DEFAULT_PARITY_THRESHOLD
    pack_budget: int = 256
    pack_rows: int = 4
    seed: int = 0
    name_prefix: str = "policy"
    stop_at_reward: float | None = None
    metrics_file: Path | None = None


def settings_from(rc: RunConfig, args: argparse.Namespace) -> LoopSettings:
    a = rc.spec.algorithm
    if a is None or not a.group_size or a.group_size < 2:
        raise LoopConfigError("spec.algorithm.groupSize: GRPO needs at least 2 samples per prompt")
    return LoopSettings(
        steps=args.steps or a.steps or 100,
        group_size=a.group_size,
        groups_per_batch=a.groups_per_batch or 16,
        max_tokens=a.max_tokens or 1,
        learning_rate=a.learning_rate or 1e-5,
        loss=a.loss or "importance_sampling",
        eval_every=args.eval_every,
        parity_threshold=args.parity_threshold,
        name_prefix=rc.name,
        stop_at_reward=args.stop_at_reward,
        metrics_file=Path(args.metrics) if args.metrics else None,
    )


# ------------------------------------------------------------------------------------------- loop


@dataclass
class Batch:
    step: int
    prompts: list[Prompt]
    completions: list[Completion]
    rewards: np.ndarray
    sample_s: float
    versions: set[int] = field(default_factory=set)


class Loop:
    def __init__(self, rc: RunConfig, settings: LoopSettings, task: Task, policy: TinyPolicy) -> None:
        self.rc, self.s, self.task, self.pol = rc, settings, task, policy
        client = gcs_client()
        self.adapters = GcsDir(rc.storage.adapters, client)
        self.ckpt = GcsDir(rc.storage.checkpoints, client)
        self.sampler = SamplerClient(rc.endpoints.samplers, settings.name_prefix)
        self.opt = policy.optimizer(settings.learning_rate)
        self.loss_cfg = LossConfig(kind=settings.loss)  # type: ignore[arg-type]
        self.lora = policy.lora0
        self.opt_state = self.opt.init(self.lora)
        self.step = 0
        self.resumed_from: int | None = None
        self._grad = jax.jit(jax.value_and_grad(self._loss, has_aux=True))
        self._apply = jax.jit(self._apply_impl)

    # ---- training numerics
    def _loss(self, lora: Any, b: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        lp = self.pol.next_token_logprobs(lora, b["tokens"], b["positions"], b["segment_ids"])
        return policy_loss(lp, b["old_logprobs"], b["advantages"], b["weight"], self.loss_cfg)

    def _apply_impl(self, lora: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        updates, opt_state = self.opt.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state

    def _packed(self, batch: Batch) -> list[dict[str, jax.Array]]:
        adv = group_advantages(jnp.asarray(batch.rewards), self.s.group_size)
        rollouts = []
        for c, a in zip(batch.completions, np.asarray(adv.advantages), strict=True):
            p = batch.prompts[c.prompt_index]
            assert p.tokens is not None, "the CPU loop trains on token prompts"
            rollouts.append(
                Rollout(
                    prompt_ids=np.asarray(p.tokens, np.int32),
                    completion_ids=np.asarray(c.tokens, np.int32),
                    advantage=float(a),
                    per_token={"old_logprobs": np.asarray(c.logprobs, np.float32)},
                )
            )
        cfg = PackConfig(budget=self.s.pack_budget, rows=self.s.pack_rows, segment_align=1)
        packed = pack_rollouts(rollouts, cfg)
        total = float(sum(pb.loss_mask.sum() for pb in packed))
        out = []
        for pb in packed:
            out.append(
                {
                    "tokens": jnp.asarray(pb.tokens),
                    "positions": jnp.asarray(pb.positions),
                    "segment_ids": jnp.asarray(pb.segment_ids),
                    "advantages": jnp.asarray(pb.advantages),
                    "old_logprobs": jnp.asarray(pb.fields["old_logprobs"]),
                    "weight": jnp.asarray(pb.loss_mask / max(total, 1.0)),
                }
            )
        return out

    def train_on_batch(self, batch: Batch) -> dict[str, float]:
        grads_sum: Any = None
        metrics: dict[str, float] = {"loss": 0.0}
        for b in self._packed(batch):
            (loss, _m), g = self._grad(self.lora, b)
            grads_sum = g if grads_sum is None else jax.tree.map(jnp.add, grads_sum, g)
            metrics["loss"] += float(loss)
        self.lora, self.opt_state = self._apply(self.lora, self.opt_state, grads_sum)
        return metrics

    def trainer_logprobs(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """(trainer, sampler) log-probs of every sampled token, for the parity gate."""
        mine, theirs = [], []
        for c in batch.completions:
            p = batch.prompts[c.prompt_index]
            assert p.tokens is not None
            seq = list(p.tokens) + list(c.tokens)
            toks = np.zeros((1, len(seq)), np.int32)
            toks[0] = seq
            lp = self.pol.next_token_logprobs(
                self.lora, jnp.asarray(toks), jnp.arange(len(seq))[None], jnp.ones_like(jnp.asarray(toks))
            )
            mine.append(np.asarray(lp)[0, len(p.tokens) :])
            theirs.append(np.asarray(c.logprobs, np.float32))
        return np.concatenate(mine), np.concatenate(theirs)

    # ---- sampling
    def sample(self, step: int, min_version: int) -> Batch:
        t0 = time.monotonic()
        prompts = self.task.train_prompts(step, self.s.groups_per_batch)
        comps = self.sampler.complete(
            prompts,
            self.s.group_size,
            self.task.max_tokens,
            self.s.temperature,
            self.s.seed * 100003 + step,
            min_version,
        )
        rewards = np.asarray(
            [self.task.reward(prompts[c.prompt_index], c.tokens, c.text) for c in comps], np.float32
        )
        return Batch(
            step, prompts, comps, rewards, time.monotonic() - t0, {version_of(c.adapter) for c in comps}
        )

    def evaluate(self) -> float:
        prompts = self.task.eval_prompts()
        comps = self.sampler.complete(prompts, 1, self.task.max_tokens, 0.0, 0, max(self.step - 1, 0))
        return float(np.mean([self.task.reward(prompts[c.prompt_index], c.tokens, c.text) for c in comps]))

    # ---- publishing and checkpoints
    def publish(self, version: int) -> None:
        with tempfile.TemporaryDirectory() as d:
            self.pol.save_peft(self.lora, Path(d))
            self.adapters.upload_dir(f"v{version}", Path(d))
        self.adapters.write(LATEST, str(version).encode())

    def save_checkpoint(self, step: int) -> None:
        leaves = jax.tree.leaves((self.lora, self.opt_state))
        data = st_save({f"{i:05d}": np.asarray(x) for i, x in enumerate(leaves)})
        self.ckpt.write(f"step_{step}/state.safetensors", data)
        self.ckpt.write(f"step_{step}/meta.json", json.dumps({"step": step, "leaves": len(leaves)}).encode())
        self.ckpt.write(LATEST, str(step).encode())

    def restore(self) -> int:
        raw = self.ckpt.read(LATEST)
        if raw is None:
            return 0
        step = int(raw.decode().strip())
        data = self.ckpt.read(f"step_{step}/state.safetensors")
        if data is None:
            raise RuntimeError(f"{self.ckpt.uri}/step_{step}/state.safetensors missing (LATEST says {step})")
        arrays = st_load(data)
        treedef = jax.tree.structure((self.lora, self.opt_state))
        leaves = [jnp.asarray(arrays[k]) for k in sorted(arrays)]
        self.lora, self.opt_state = jax.tree.unflatten(treedef, leaves)
        return step

    def report(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec)
        print(line, flush=True)
        if self.s.metrics_file:
            with self.s.metrics_file.open("a") as f:
                f.write(line + "\n")
        target = self.rc.progress.file
        if target:
            rep = ProgressReport(
                step=rec["step"],
                last_checkpoint_step=rec.get("checkpoint_step"),
                resumed_from_step=self.resumed_from,
                reward_mean=rec.get("reward_mean"),
                adapter_version=rec.get("adapter_version"),
                update_time=datetime.now(UTC),
            )
            tmp = Path(target + ".tmp")
            tmp.write_text(rep.model_dump_json())
            tmp.replace(target)

    # ---- the driver
    def run(self) -> int:
        self.step = self.restore()
        if self.step:
            self.resumed_from = self.step
            log.warning("resumed at step %d from %s", self.step, self.ckpt.uri)
        latest = self.adapters.read(LATEST)
        if latest is None or int(latest.decode().strip()) < self.step:
            self.publish(self.step)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sampling")
        pending: Future[Batch] = pool.submit(self.sample, self.step, max(self.step - 1, 0))
        if self.step == 0:
            first = pending.result()
            mine, theirs = self.trainer_logprobs(first)
            diff = float(np.mean(np.abs(mine - theirs)))
            print(
                json.dumps(
                    {
                        "parity_mean_abs_diff": diff,
                        "threshold": self.s.parity_threshold,
                        "tokens": int(mine.size),
                    }
                ),
                flush=True,
            )
            if not np.isfinite(diff) or diff > self.s.parity_threshold:
                print(
                    f"parity gate: trainer and sampler log-probs differ by {diff:.3g} nats on the same "
                    f"weights (threshold {self.s.parity_threshold:.3g}); refusing to train",
                    file=sys.stderr,
                )
                pool.shutdown(wait=False)
                return EXIT_BAD_CONFIG
            done: Future[Batch] = Future()
            done.set_result(first)
            pending = done
        while self.step < self.s.steps:
            batch = pending.result()
            step = self.step
            # Sample the next step while this one trains; it may use v{step} at the oldest (lag <= 1).
            if step + 1 < self.s.steps:
                pending = pool.submit(self.sample, step + 1, step)
            t0 = time.monotonic()
            m = self.train_on_batch(batch)
            train_s = time.monotonic() - t0
            self.step = step + 1
            t1 = time.monotonic()
            self.publish(self.step)
            ckpt_step = None
            if self.step % self.s.checkpoint_every == 0 or self.step == self.s.steps:
                self.save_checkpoint(self.step)
                ckpt_step = self.step
            rec: dict[str, Any] = {
                "step": step,
                "reward_mean": round(float(batch.rewards.mean()), 4),
                "loss": round(m["loss"], 6),
                "policy_lag": step - min(batch.versions),
                "sampled_with": sorted(batch.versions),
                "adapter_version": self.step,
                "checkpoint_step": ckpt_step,
                "sample_s": round(batch.sample_s, 3),
                "train_s": round(train_s, 3),
                "publish_s": round(time.monotonic() - t1, 3),
                "sampler_wait_s": round(self.sampler.waited_s, 3),
                "time": round(time.time(), 3),
            }
            if self.s.eval_every and self.step % self.s.eval_every == 0:
                rec["eval_reward"] = round(self.evaluate(), 4)
            self.report(rec)
            if self.s.stop_at_reward is not None and rec["reward_mean"] >= self.s.stop_at_reward:
                break
        pool.shutdown(wait=False, cancel_futures=True)
        return 0


def build_policy(rc: RunConfig) -> TinyPolicy:
    lora = rc.spec.lora
    rank = lora.rank if lora and lora.rank else 8
    alpha = lora.alpha if lora and lora.alpha else 2.0 * rank
    return TinyPolicy(TinySpec(lora_rank=rank, lora_alpha=alpha))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rljob-trainer-loop", description=__doc__.splitlines()[0])
    p.add_argument(
        "--config", default=os.environ.get(CONFIG_ENV), help="RunConfig JSON (default $RLJOB_CONFIG)"
    )
    p.add_argument("--steps", type=int, default=None, help="override spec.algorithm.steps")
    p.add_argument(
        "--eval-every", type=int, default=10, help="evaluate held-out prompts every N steps (0: never)"
    )
    p.add_argument("--parity-threshold", type=float, default=DEFAULT_PARITY_THRESHOLD)
    p.add_argument(
        "--stop-at-reward", type=float, default=None, help="stop once a step's mean reward reaches this"
    )
    p.add_argument("--metrics", default=None, help="also append the JSON lines to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parser().parse_args(argv)
    if not args.config:
        print("--config: no run config (pass --config or set RLJOB_CONFIG)", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        rc = RunConfig.load(args.config)
        settings = settings_from(rc, args)
    except (OSError, ValidationError, LoopConfigError) as e:
        print(f"--config {args.config}: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    task = SuccessorTask()
    if task.max_tokens != settings.max_tokens:
        log.info("task %s uses max_tokens=%d", task.name, task.max_tokens)
    return Loop(rc, settings, task, build_policy(rc)).run()


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Loop", "LoopSettings", "SamplerClient", "main"]
