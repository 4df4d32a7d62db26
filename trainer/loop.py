"""The RL loop driver: the sampler side of each step, plugged into the trainer runtime.

rljob.trainer.runtime.run owns the step (restore, rollout cache, compiled train step, orbax checkpoint,
adapter export `v{N}` + LATEST, progress, JSON step lines); this module is its rollout source. For step
`s` (the policy after `s` updates is adapter version `v{s}`):
1. take step `s`'s rollouts: `groupSize` completions per prompt from the sampler(s) over HTTP
   (`/v1/completions` with a served adapter version, per-token log-probs of the sampled tokens), graded
   by the task's reward, with GRPO advantages per group (rljob.trainer.losses.group_advantages);
2. before returning them, start sampling step `s+1` in the background with the newest served version,
   at least `v{s}`: it overlaps the gradient of step `s`, and the policy lag (trainer step minus sampling
   version) stays at most one; it is recorded in every step line (`policy_lag`, `sampled_with`);
3. every `--eval-every` steps, greedy completions of the held-out prompts (`eval_reward`).

Before the first step, a parity gate compares the trainer's log-probs of the first batch's tokens with
the sampler's on the same weights (adapter v0): the mean absolute difference is logged and the run is
refused (exit 2) above `--parity-threshold`. The samplers come from RunConfig.endpoints.samplers (JobSet
DNS names in a cluster, local ports here); an unreachable or restarting sampler is waited for.

`rljob-trainer --config run.json` (the pods' command; rljob.trainer.main, default `--rollouts sampler`)
initializes jax.distributed and calls :func:`main` here; `python -m rljob.trainer.loop` is the same loop
without that step (one process):

    python -m rljob.trainer.loop --config run.json --model tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import ValidationError
from rljob.recipes import startup
from rljob.recipes.failure import EXIT_BAD_CONFIG, EXIT_OK
from rljob.recipes.plan import DEFAULT_PROMPT_TEMPLATE
from rljob.recipes.runconfig import CONFIG_ENV, RunConfig
from rljob.trainer.data import DatasetError, MathTask, Prompt, SuccessorTask, Task
from rljob.trainer.losses import AdvantageNormalization, group_advantages
from rljob.trainer.packing import PackConfig, Rollout, align_up, pack_rollouts

log = logging.getLogger("rljob.trainer.loop")

PARITY_ALIGN = 128  # row budget rounding of the parity gate when no pack shape is given
DEFAULT_PARITY_THRESHOLD = 1e-3  # nats; the seed measured 1.7e-4 on TPU, CPU float32 gives ~1e-6


class LoopConfigError(ValueError):
    """A setting the loop cannot run with; the message names the field."""


class ParityError(RuntimeError):
    """Trainer and sampler disagree on the log-probs of the same tokens under the same weights."""


# ------------------------------------------------------------------------------------- the sampler


class SamplerUnavailable(RuntimeError):
    pass


class SamplerRejected(RuntimeError):
    """The sampler answered 4xx (other than 404, an adapter being swapped): a request it will never take."""


class SamplerClosed(RuntimeError):
    """The client was closed while a request was waiting for a sampler (the loop is shutting down)."""


@dataclass
class Completion:
    prompt_index: int
    tokens: list[int]
    logprobs: list[float]
    text: str
    adapter: str
    prompt_tokens: list[int] | None = None  # the sampler's tokenization of a text prompt

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids as the sampler saw them: the trainer trains on exactly those."""
        if prompt.tokens is not None:
            return list(prompt.tokens)
        if self.prompt_tokens is None:
            raise SamplerRejected(
                "a text prompt's completion came back without prompt_token_ids: the sampler must return "
                "them for return_token_ids (vLLM >= 0.10.2)"
            )
        return self.prompt_tokens


class SamplerClient:
    """OpenAI-style completions against one or more samplers (vLLM or the CPU backend)."""

    def __init__(
        self,
        urls: list[str],
        name_prefix: str,
        timeout: float = 300.0,
        retry_s: float = 0.05,
        max_seqs: int = 256,
        inflight: int = 1,
    ) -> None:
        if not urls:
            raise LoopConfigError("endpoints.samplers: no sampler URL in the run config")
        if max_seqs < 1 or inflight < 1:
            raise LoopConfigError(f"spec.sampler.maxNumSeqs: {max_seqs} (and {inflight} slots) must be >= 1")
        self.max_seqs, self.inflight = max_seqs, inflight
        # Per replica: requests in flight at once (back-pressure), shared by every call of this client.
        self._slots = [threading.BoundedSemaphore(inflight) for _ in urls]
        self.urls = [u.rstrip("/") for u in urls]
        self.prefix = name_prefix
        self.timeout = timeout
        self.retry_s = retry_s
        self.waited_s = 0.0
        self._closed = threading.Event()

    def close(self) -> None:
        """Stop waiting: a request that is waiting for a sampler (or for an adapter version that will never
        come, because the trainer failed) raises SamplerClosed within retry_s, so its thread ends and the
        process can exit. Without this a failed trainer would hang in its sampling thread at exit and its
        pod would never fail (no restart, no status)."""
        self._closed.set()

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
            if self._closed.is_set():
                raise SamplerClosed(f"{what}: the sampler client was closed")
            try:
                out = fn()
                if warned:
                    log.warning("sampler back after %.1fs (%s)", time.monotonic() - t0, what)
                self.waited_s += time.monotonic() - t0 if warned else 0.0
                return out
            except (urllib.error.URLError, ConnectionError, TimeoutError, SamplerUnavailable, OSError) as e:
                if isinstance(e, urllib.error.HTTPError) and 400 <= e.code < 500 and e.code != 404:
                    # The sampler refuses the request itself: waiting would not help.
                    body = e.read().decode(errors="replace")[:300]
                    raise SamplerRejected(f"{what}: HTTP {e.code}: {body}") from e
                if not warned:
                    log.warning("sampler unavailable (%s): %s; waiting", what, e)
                    warned = True
                self._closed.wait(self.retry_s)

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
        self, prompts: list[Prompt], n: int, max_tokens: int, temperature: float, min_version: int
    ) -> list[Completion]:
        """`n` completions per prompt, from all the samplers at once.

        The prompts are cut into requests of at most ``max_seqs`` sequences (a replica's
        ``--max-num-seqs``) and no more than an even share of the replicas; each replica has ``inflight``
        request slots (per client, so a concurrent evaluation shares them), and a free slot takes the next
        request from the queue: a faster replica serves more, and a replica that is down, restarting or
        still on an older adapter version puts its request back for the others (and retries after
        ``retry_s``). A 4xx answer (other than 404) fails the call (SamplerRejected).

        No per-request ``seed`` is sent: vLLM's TPU backend refuses any request that carries one
        (``TpuPlatform.validate_request`` in https://github.com/vllm-project/tpu-inference/blob/main/
        tpu_inference/platforms/tpu_platform.py: "JAX does not support per-request seed"); a
        sampler's randomness is its own (vLLM's server-wide ``--seed``; the CPU backend's likewise)."""
        if not prompts:
            return []
        per_request = max(1, min(self.max_seqs // max(1, n), -(-len(prompts) // len(self.urls))))
        queue: deque[list[int]] = deque(
            list(range(i, min(i + per_request, len(prompts)))) for i in range(0, len(prompts), per_request)
        )
        results: list[list[Completion]] = []
        failures: list[BaseException] = []
        cond = threading.Condition()
        state: dict[str, Any] = {"pending": len(queue), "wait_from": None}

        def body_of(idxs: list[int], version: int) -> dict[str, Any]:
            return {
                "model": f"{self.prefix}-v{version}",
                "prompt": [
                    prompts[i].tokens if prompts[i].tokens is not None else prompts[i].text for i in idxs
                ],
                "n": n,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "logprobs": 0,
                "return_token_ids": True,
            }

        def worker(u: int) -> None:
            url, slots = self.urls[u], self._slots[u]
            while True:
                with cond:
                    while not queue and state["pending"] and not failures and not self._closed.is_set():
                        cond.wait(self.retry_s)
                    if not state["pending"] or failures or self._closed.is_set():
                        return
                    idxs = queue.popleft()
                try:
                    with slots:
                        version = self.served_version(url)
                        if version is None or version < min_version:
                            raise SamplerUnavailable(
                                f"{url} serves adapter v{version}, waiting for >= v{min_version}"
                            )
                        resp = self._request(f"{url}/v1/completions", body_of(idxs, version))
                    comps = _completions(resp, idxs, n)
                except (
                    urllib.error.URLError,
                    ConnectionError,
                    TimeoutError,
                    SamplerUnavailable,
                    OSError,
                ) as e:
                    rejected = (
                        e
                        if isinstance(e, urllib.error.HTTPError) and 400 <= e.code < 500 and e.code != 404
                        else None
                    )
                    with cond:
                        if rejected is not None:
                            # The sampler refuses the request itself: waiting would not help.
                            text = rejected.read().decode(errors="replace")[:300]
                            failures.append(SamplerRejected(f"completions: HTTP {rejected.code}: {text}"))
                        else:
                            if state["wait_from"] is None:
                                state["wait_from"] = time.monotonic()
                                log.warning(
                                    "sampler unavailable (adapter >= v%d): %s: %s; waiting",
                                    min_version,
                                    url,
                                    e,
                                )
                            queue.appendleft(idxs)
                        cond.notify_all()
                    if rejected is None:
                        self._closed.wait(self.retry_s)
                    continue
                except (KeyError, ValueError, TypeError) as e:
                    with cond:
                        failures.append(SamplerRejected(f"completions from {url}: malformed answer: {e!r}"))
                        cond.notify_all()
                    return
                with cond:
                    results.append(comps)
                    state["pending"] -= 1
                    if state["wait_from"] is not None:
                        waited = time.monotonic() - state["wait_from"]
                        log.warning("sampler back after %.1fs", waited)
                        self.waited_s += waited
                        state["wait_from"] = None
                    cond.notify_all()

        threads = [
            threading.Thread(target=worker, args=(u,), daemon=True, name=f"sampler-{u}-{k}")
            for u in range(len(self.urls))
            for k in range(self.inflight)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
        if state["pending"]:
            raise SamplerClosed("completions: the sampler client was closed")
        out = [c for part in results for c in part]
        out.sort(key=lambda c: c.prompt_index)
        return out


def _completions(resp: Any, idxs: list[int], n: int) -> list[Completion]:
    """The completions of one /v1/completions answer for prompts ``idxs`` (``n`` choices each)."""
    model = str(resp["model"])
    out = []
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
                prompt_tokens=(
                    [int(t) for t in ch["prompt_token_ids"]] if ch.get("prompt_token_ids") else None
                ),
            )
        )
    return out


def version_of(adapter: str) -> int:
    return int(adapter.rsplit("-v", 1)[1])


# ------------------------------------------------------------------------------------- the source


@dataclass
class Batch:
    step: int
    prompts: list[Prompt]
    completions: list[Completion]
    rewards: np.ndarray
    sample_s: float
    versions: set[int] = field(default_factory=set)


LogprobFn = Callable[[Any, np.ndarray, np.ndarray, np.ndarray], Any]


def grpo_rollouts(
    batch: Batch, group_size: int, normalization: AdvantageNormalization = "mean"
) -> tuple[list[Rollout], int]:
    """The graded batch's training rollouts and how many groups were skipped: GRPO advantages per group
    (rljob.trainer.losses.group_advantages); a group whose rewards are all equal carries no signal and
    none of its rollouts is returned (never packed, run or counted in the step's token mean)."""
    adv = group_advantages(jnp.asarray(batch.rewards), group_size, normalization=normalization)
    rollouts = []
    for c, a, valid in zip(batch.completions, np.asarray(adv.advantages), np.asarray(adv.valid), strict=True):
        if not valid:
            continue
        ids = c.prompt_ids(batch.prompts[c.prompt_index])
        rollouts.append(
            Rollout(
                prompt_ids=np.asarray(ids, np.int32),
                completion_ids=np.asarray(c.tokens, np.int32),
                advantage=float(a),
                per_token={"old_logprobs": np.asarray(c.logprobs, np.float32)},
            )
        )
    return rollouts, int(adv.groups_skipped)


class SamplerSource:
    """The runtime's RolloutSource: pipelined sampling, grading, advantages, parity gate, evaluation."""

    def __init__(
        self,
        client: SamplerClient,
        task: Task,
        *,
        steps: int,
        group_size: int,
        groups_per_batch: int,
        logprobs: LogprobFn,
        temperature: float = 1.0,
        eval_every: int = 10,
        parity_threshold: float = DEFAULT_PARITY_THRESHOLD,
        emit: Callable[[dict[str, Any]], None] | None = None,
        advantage_normalization: AdvantageNormalization = "mean",
        pack: PackConfig | None = None,
        parity_rows: int = 1,
        parity_len: int | None = None,
    ) -> None:
        problem = startup.group_size_problem(group_size)  # the plan makes the same check
        if problem:
            raise LoopConfigError(problem)
        self.client, self.task, self.steps = client, task, steps
        self.group_size, self.groups = group_size, groups_per_batch
        self.logprobs, self.temperature, self.eval_every = logprobs, temperature, eval_every
        self.parity_threshold = parity_threshold
        self.pack = pack  # the train step's micro-batch shape, for the parity gate
        self.parity_shapes: set[tuple[int, int]] = set()
        self.advantage_normalization = advantage_normalization
        self.emit = emit or (lambda rec: print(json.dumps(rec), flush=True))
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sampling")
        self.pending: dict[int, Future[Batch]] = {}
        self.parity_checked = False
        # The parity batch is scored in one padded [rows, len] shape: rows a multiple of ``parity_rows``
        # (the trainer mesh's size, so every batch axis divides it), len ``parity_len`` (the model's).
        self.parity_rows, self.parity_len = max(1, parity_rows), parity_len
        # With several trainer processes only process 0 samples; the gate's inputs wait here for the
        # runtime's collective() call, which every process makes (the scoring is one SPMD program).
        self.parity_due: bytes = b""
        self.lock = threading.Lock()

    def sample(self, step: int, min_version: int) -> Batch:
        t0 = time.monotonic()
        prompts = self.task.train_prompts(step, self.groups)
        comps = self.client.complete(
            prompts,
            self.group_size,
            self.task.max_tokens,
            self.temperature,
            min_version,
        )
        # Graded later, on the caller's thread (see grade()).
        return Batch(
            step,
            prompts,
            comps,
            np.zeros(0, np.float32),
            time.monotonic() - t0,
            {version_of(c.adapter) for c in comps},
        )

    def grade(self, batch: Batch) -> np.ndarray:
        """Rewards of a batch, computed on the loop's (main) thread: graders such as math-verify time
        themselves out with signal.alarm, which only works there."""
        return np.asarray(
            [self.task.reward(batch.prompts[c.prompt_index], c.tokens, c.text) for c in batch.completions],
            np.float32,
        )

    def _prefetch(self, step: int, min_version: int) -> None:
        if step < self.steps and step not in self.pending:
            self.pending[step] = self.pool.submit(self.sample, step, min_version)

    def parity_inputs(self, batch: Batch) -> dict[str, np.ndarray]:
        """The batch's rollouts packed in the train step's ``[rows, budget]`` micro-batch shape (``pack``),
        stacked ``[micro-batches, rows, budget]``, with the sampler's log-prob of each sampled token at its
        position and a mask of those positions. One shape: the log-prob function compiles once, for the
        shape the step already runs, not once per distinct rollout length (on a TPU each would be a compile
        of the whole model). Without ``pack`` (tests): rows a multiple of ``parity_rows`` (the trainer
        mesh's size), budget ``parity_len`` or the longest rollout aligned up."""
        rollouts = [
            Rollout(
                prompt_ids=np.asarray(c.prompt_ids(batch.prompts[c.prompt_index]), np.int32),
                completion_ids=np.asarray(c.tokens, np.int32),
                per_token={"sampler_logprobs": np.asarray(c.logprobs, np.float32)},
            )
            for c in batch.completions
        ]
        cfg = self.pack
        if cfg is None:
            longest = max(r.num_tokens for r in rollouts)
            budget = max(self.parity_len or 0, align_up(longest, PARITY_ALIGN))
            cfg = PackConfig(budget=budget, rows=self.parity_rows)
        elif cfg.rows % self.parity_rows:
            # rows over the whole mesh: every batch axis divides a multiple of its size
            cfg = dataclasses.replace(cfg, rows=align_up(cfg.rows, self.parity_rows))
        mbs = pack_rollouts(rollouts, cfg)
        return {
            "tokens": np.stack([mb.tokens for mb in mbs]),
            "positions": np.stack([mb.positions for mb in mbs]),
            "segments": np.stack([mb.segment_ids for mb in mbs]),
            "sampler": np.stack([mb.fields["sampler_logprobs"] for mb in mbs]).astype(np.float32),
            # the completion tokens
            "mask": np.stack([(mb.segment_ids > 0) & (mb.prompt_mask == 0) for mb in mbs]).astype(np.float32),
        }

    def parity_of(self, inputs: dict[str, np.ndarray], lora: Any) -> float:
        """Mean |trainer - sampler| log-prob over the sampled tokens (same weights), one micro-batch at a
        time. With several processes every one must call it (one program over the global mesh)."""
        total, count = 0.0, 0.0
        for i in range(inputs["tokens"].shape[0]):
            toks = inputs["tokens"][i]
            out = self.logprobs(lora, toks, inputs["positions"][i], inputs["segments"][i])
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                out = multihost_utils.process_allgather(out, tiled=True)
            lp = np.asarray(out, np.float32)
            mask = inputs["mask"][i]
            total += float(np.sum(np.abs(lp - inputs["sampler"][i]) * mask))
            count += float(mask.sum())
            self.parity_shapes.add((int(toks.shape[0]), int(toks.shape[1])))
        return total / max(count, 1.0)

    def parity(self, batch: Batch, lora: Any) -> float:
        """Mean |trainer - sampler| log-prob over the batch's sampled tokens (same weights)."""
        return self.parity_of(self.parity_inputs(batch), lora)

    def check_parity(self, step: int, diff: float) -> None:
        self.emit(
            {
                "event": "parity",
                "step": step,
                "mean_abs_logprob_diff": diff,
                "threshold": self.parity_threshold,
                "adapter_version": step,
            }
        )
        if not np.isfinite(diff) or diff > self.parity_threshold:
            raise ParityError(
                f"trainer and sampler log-probs differ by {diff:.3g} nats on the same weights "
                f"(adapter v{step}; threshold {self.parity_threshold:.3g}): refusing to train"
            )
        self.parity_checked = True

    def collective(self, step: int, lora: Any) -> None:
        """Called by the runtime on every process after each step's rollouts are shared: with several
        processes, the parity gate that process 0's call deferred runs here, on all of them."""
        if jax.process_count() == 1 or self.parity_checked:
            return
        from rljob.trainer.runtime import share_from_first

        payload = share_from_first(self.parity_due if jax.process_index() == 0 else None)
        self.parity_due = b""
        if not payload:
            return
        with np.load(io.BytesIO(payload)) as z:
            inputs = {k: z[k] for k in z.files}
        self.check_parity(step, self.parity_of(inputs, lora))

    def evaluate(self, min_version: int) -> float:
        prompts = self.task.eval_prompts()
        comps = self.client.complete(prompts, 1, self.task.max_tokens, 0.0, min_version)
        return float(np.mean([self.task.reward(prompts[c.prompt_index], c.tokens, c.text) for c in comps]))

    def __call__(self, step: int, lora: Any) -> tuple[list[Rollout], dict[str, float]]:
        # The runtime calls this after publishing v{step}: sample step `step` with >= v{step-1}.
        self._prefetch(step, max(step - 1, 0))
        batch = self.pending.pop(step).result()
        batch.rewards = self.grade(batch)
        if not self.parity_checked and not self.parity_due and min(batch.versions) == step:
            if jax.process_count() > 1:  # scored in collective(), on every process
                buf = io.BytesIO()
                np.savez(buf, **self.parity_inputs(batch))  # type: ignore[arg-type]
                self.parity_due = buf.getvalue()
            else:
                self.check_parity(step, self.parity(batch, lora))
        # Overlap: step+1 samples while this step trains, with v{step} at the oldest (lag <= 1).
        self._prefetch(step + 1, step)
        rollouts, skipped = grpo_rollouts(batch, self.group_size, self.advantage_normalization)
        metrics: dict[str, float] = {
            "reward_mean": float(batch.rewards.mean()),
            "policy_lag": float(step - min(batch.versions)),
            "sampled_with": float(min(batch.versions)),
            "groups_skipped": float(skipped),
            "sample_s": batch.sample_s,
            "sampler_wait_s": self.client.waited_s,
        }
        if self.eval_every and step % self.eval_every == 0:
            metrics["eval_reward"] = self.evaluate(max(step - 1, 0))
        return rollouts, metrics

    def close(self) -> None:
        """Cancel queued sampling and end the one in flight (the client stops waiting)."""
        self.client.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------------------------ main


def task_of(rc: RunConfig, seed: int = 0) -> Task:
    """The run's prompts and grader (spec.dataset): the math problems it names, read once at start (a
    missing or malformed file is bad configuration: exit 2, never retried), or the CPU toy task."""
    d = rc.spec.dataset
    if d is None or d.task == "successor":
        return SuccessorTask()  # its train/eval split is fixed; the seed varies only the sampling
    from rljob.trainer.storage import open_store

    assert d.path, "the plan fills spec.dataset.path for task math"
    parent, _, name = d.path.rpartition("/")
    from google.api_core import exceptions as gexc

    try:
        data = open_store(parent).read(name)
    except (PermissionError, IsADirectoryError, gexc.Forbidden, gexc.Unauthorized, gexc.BadRequest) as e:
        # Access the run will never get by retrying. Anything else (a 503, a timeout) propagates: a
        # crash, restarted and counted like any other.
        raise DatasetError(f"spec.dataset.path: cannot read {d.path}: {type(e).__name__}: {e}") from None
    if data is None:
        raise DatasetError(f"spec.dataset.path: {d.path} does not exist (upload the problems there)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise DatasetError(f"spec.dataset.path: {d.path} is not UTF-8 text") from None
    alg = rc.spec.algorithm
    return MathTask.from_jsonl(
        text,
        d.path,
        template=d.prompt_template or DEFAULT_PROMPT_TEMPLATE,
        eval_size=d.eval_size or 64,
        max_tokens=alg.max_tokens if alg and alg.max_tokens else 1024,
        seed=seed,
    )


def cpu_step_config(rc: RunConfig, max_len: int) -> Any:
    """The compiled step of the CPU loop's tiny model (rows of ``max_len`` tokens) with the run config's
    algorithm: its loss, learning rate, KL penalty against the base policy, and the log-prob head's
    block sizes (spec.trainer.logprobs, clamped by the head to the tiny shapes)."""
    from rljob.trainer.losses import LossConfig
    from rljob.trainer.main import head_blocks
    from rljob.trainer.train_step import StepConfig

    alg = rc.spec.algorithm
    return StepConfig(
        budget=max_len,
        rows=4,
        micro_batches=8,
        segment_align=1,
        learning_rate=alg.learning_rate if alg and alg.learning_rate else 1e-5,
        loss=LossConfig(
            kind=alg.loss if alg and alg.loss else "importance_sampling",
            kl_coef=alg.kl_penalty_coef if alg and alg.kl_penalty_coef else 0.0,
        ),
        **head_blocks(rc),
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rljob.trainer.loop", description=__doc__.splitlines()[0])
    p.add_argument(
        "--config", default=os.environ.get(CONFIG_ENV), help="RunConfig JSON (default $RLJOB_CONFIG)"
    )
    p.add_argument(
        "--model",
        choices=["tiny", "miniature", "config"],
        default="tiny",
        help="tiny: the CPU loop's tiny MaxText model (rljob.trainer.tinypolicy.cpu_model_spec); "
        "miniature: the miniature of the run's model on the run config's mesh (rljob drill; "
        "rljob.trainer.tinypolicy.miniature_spec); "
        "config: the run config's MaxText model and packed shape (rljob.trainer.main.model_setup)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the task's prompts (e.g. math sampling)")
    p.add_argument("--tensorboard-dir", default=None)
    p.add_argument("--steps", type=int, default=None, help="override spec.algorithm.steps")
    p.add_argument(
        "--eval-every", type=int, default=10, help="evaluate held-out prompts every N steps (0: never)"
    )
    p.add_argument("--parity-threshold", type=float, default=DEFAULT_PARITY_THRESHOLD)
    p.add_argument("--log-jsonl", default=None, help="also append the JSON lines to this file")
    p.add_argument("--checkpoint-every", type=int, default=1)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # usage errors are bad configuration
        return EXIT_BAD_CONFIG if e.code not in (0, None) else EXIT_OK
    if not args.config:
        print("--config: no run config (pass --config or set RLJOB_CONFIG)", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        rc = RunConfig.load(args.config)
    except (OSError, ValidationError) as e:
        print(f"--config {args.config}: {str(e).splitlines()[0]}", file=sys.stderr)
        return EXIT_BAD_CONFIG

    from rljob.trainer import caches
    from rljob.trainer.main import BadConfig, align, max_non_finite_steps, model_setup
    from rljob.trainer.model import Policy
    from rljob.trainer.progress import Reporter, StepLog, sink_for
    from rljob.trainer.runtime import Diverged, RunPaths, RunSettings, run
    from rljob.trainer.tinypolicy import cpu_model_spec, cpu_shape, miniature_spec
    from rljob.trainer.train_step import Trainer, for_model

    spec, alg = rc.spec, rc.spec.algorithm
    lora = spec.lora
    rank = lora.rank if lora and lora.rank else 8
    alpha = lora.alpha if lora and lora.alpha else 2.0 * rank
    steps = args.steps or (alg.steps if alg and alg.steps else 100)
    # JAX's compilation cache, restored from storage.cache before anything compiles.
    jax_cache = caches.jax_compilation_cache(
        caches.JAX_TRAINER, rc.storage.cache, caches.local_root(), rc.trainer.maxtext
    )
    try:
        task = task_of(rc, args.seed)
        client = SamplerClient(rc.endpoints.samplers, rc.name, max_seqs=rc.sampler.max_num_seqs)
        if args.model == "config":
            model_spec, step_cfg, _ = model_setup(rc, "config", args.steps)
        elif args.model == "miniature":
            model_spec = miniature_spec(
                rc, mesh=True, checkpoint=spec.model.checkpoint if spec.model else None
            )
            step_cfg = cpu_step_config(rc, int(model_spec.maxtext["max_target_length"]))
        else:
            vocab, max_len = cpu_shape(rc)
            model_spec = cpu_model_spec(
                rank,
                alpha,
                checkpoint=spec.model.checkpoint if spec.model else None,
                vocab_size=vocab,
                max_len=max_len,
            )
            step_cfg = cpu_step_config(rc, max_len)
        step_cfg = for_model(step_cfg, model_spec.decoder_block)  # the train step's packing, also here
        align("rljob-policy")  # the policy's first collective, with every process there (rljob.trainer.main)
        policy = Policy(model_spec)
        # The base weights as a jit argument, not a constant: with several processes they span devices
        # this process cannot address, which a jitted function may take but not close over.
        scored = jax.jit(lambda base, lora, t, p, s: policy.next_token_logprobs(lora, t, p, s, base=base))
        source = SamplerSource(
            client,
            task,
            steps=steps,
            group_size=alg.group_size if alg and alg.group_size else 8,
            groups_per_batch=alg.groups_per_batch if alg and alg.groups_per_batch else 16,
            logprobs=lambda lora, t, p, s: scored(policy.base, lora, t, p, s),
            pack=step_cfg.pack_config(),
            parity_rows=int(policy.mesh.size),
            parity_len=int(policy.cfg.max_target_length),
            eval_every=args.eval_every,
            parity_threshold=args.parity_threshold,
            advantage_normalization=(
                alg.advantage_normalization if alg and alg.advantage_normalization else "mean"
            ),
        )
    except (LoopConfigError, ValueError, BadConfig, DatasetError) as e:
        print(str(e).splitlines()[0], file=sys.stderr)
        return EXIT_BAD_CONFIG
    first = jax.process_index() == 0
    tb_dir = args.tensorboard_dir or rc.storage.tensorboard  # under storage.root: outlives the process
    steplog = StepLog(tb_dir if first else None, args.log_jsonl)
    source.emit = lambda rec: steplog.event(rec.pop("event"), **rec)
    reporter = Reporter(sink_for(rc, in_cluster="KUBERNETES_SERVICE_HOST" in os.environ) if first else None)
    try:
        run(
            Trainer(policy, step_cfg),
            RunPaths(rc.storage.checkpoints, rc.storage.adapters, rc.storage.rollouts),
            RunSettings(
                steps=steps,
                checkpoint_every=args.checkpoint_every,
                export_adapters=first,
                max_non_finite_steps=max_non_finite_steps(rc),
            ),
            source,
            steplog=steplog,
            reporter=reporter,
            to_peft=policy.to_peft,
            peft_config=policy.peft_config(),
        )
    except ParityError as e:
        print(f"parity gate: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except Diverged as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_CONFIG
    except SamplerRejected as e:
        print(f"sampler rejected a request (check spec.algorithm, spec.sampler): {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    finally:
        source.close()
        jax_cache.close()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["DEFAULT_PARITY_THRESHOLD", "ParityError", "SamplerClient", "SamplerSource", "main"]
