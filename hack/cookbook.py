"""`make tinker-cookbook`: the Tinker Cookbook's own training loops, unmodified, against `make tinker-cpu`.

Runs in the Cookbook's virtual environment (`.cache/cookbook/venv`: tinker-cookbook, torch and the `tinker`
SDK; none of them is the project's), and starts the service in the project's (`.venv`, `python -m
rljob.local.tinker_cpu`: the Tinker service and the CPU sampler over the tiny byte-token model, storage on
the GCS emulator). Everything on the user's side is here and public Cookbook API:

- a byte tokenizer (a token is one UTF-8 byte, the tiny model's vocabulary), registered under the service's
  base model name with ``tinker_cookbook.tokenizer_utils.register_tokenizer``: no hub;
- a toy RL task of our own, ``Env`` / ``EnvGroupBuilder`` / ``RLDataset`` / ``RLDatasetBuilder`` (no
  datasets): the prompt is one letter (A..H, a..h), the answer one sampled byte, reward 1 for a letter of the
  prompt's case (by chance about 1 in 10: 26 of 256 bytes); its test set, the 16 prompts, is scored by the
  Cookbook's ``RLTestSetEvaluator``. ``--task sum`` asks instead for the digit d + 1 after ``"1+d"`` (1 in
  256 by chance): the Cookbook's GRPO (rewards centred per group) gives a group where no sample is right no
  gradient at all, so the first answer learned spreads to every prompt and the policy settles on it (one
  prompt in nine right);
- a supervised dataset of our own (each prompt letter followed by a letter of its case, every byte weighted).

Phases (each a call of the Cookbook's ``main``, one log directory each):

1. ``tinker_cookbook.rl.train.main`` for ``--rl-first`` iterations (its default loss, importance_sampling;
   the datums carry provenance spans, as 0.6.x builds them), checkpointing every ``--save-every``;
2. the same config and log directory with ``--rl-steps`` iterations: the Cookbook resumes from its own
   checkpoint (``checkpoints.jsonl``) and trains on;
3. ``tinker_cookbook.supervised.train.main`` for ``--sl-steps`` steps.

Then one JSON line: the right-answer rate per RL iteration (``env/all/correct``, read from the Cookbook's
``metrics.jsonl``), the test-set rate, the iteration phase 2 resumed at, the supervised NLL per step; exit 1
when the RL run did not go from chance to ``--want`` on its last three iterations, did not resume where
phase 1 ended, or the supervised NLL did not fall by half.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import chz
import tinker
import torch
from tinker_cookbook import tokenizer_utils
from tinker_cookbook.completers import StopCondition
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.common import datum_from_model_input_weights
from tinker_cookbook.supervised.types import SupervisedDataset, SupervisedDatasetBuilder

API_KEY = "tml-cookbook-local"  # also set as the service's only accepted key (RLJOB_TINKER_API_KEYS)
NEWLINE = 10


# ------------------------------------------------------------------------------------------ tokenizer


class ByteTokenizer:
    """The tiny model's tokens: UTF-8 bytes (the subset of a Hugging Face tokenizer the Cookbook calls)."""

    name_or_path = "bytes"
    eos_token = "\n"
    eos_token_id = NEWLINE
    bos_token = None
    bos_token_id = None
    all_special_ids: tuple[int, ...] = ()
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int] | int, skip_special_tokens: bool = False) -> str:
        seq = [ids] if isinstance(ids, int) else list(ids)
        return bytes(int(t) for t in seq).decode(errors="replace")

    def __len__(self) -> int:
        return self.vocab_size


# ------------------------------------------------------------------------------------------- RL task


CASE_PROMPTS = "AaBbCcDdEeFfGgHh"


def prompt_of(d: int, task: str = "sum") -> str:
    return CASE_PROMPTS[d % len(CASE_PROMPTS)] if task == "case" else f"1+{d}"


def answer_of(d: int, task: str = "sum") -> int:
    """The right answer (case: the prompt letter's successor, one of the right ones)."""
    return ord(prompt_of(d, task)) + 1 if task == "case" else ord(str(d + 1))


def is_right(d: int, byte: int, task: str = "sum") -> bool:
    """sum: the digit d + 1; case: a letter of the prompt letter's case."""
    if task == "case":
        c = chr(byte)
        return c.isascii() and c.isalpha() and c.isupper() == prompt_of(d, task).isupper()
    return byte == answer_of(d)


class ToyEnv(Env):
    """One prompt, one sampled byte: reward 1 for a right answer (optionally shaped, sum only)."""

    def __init__(self, d: int, digit_reward: float = 0.0, task: str = "sum") -> None:
        self.d, self.digit_reward, self.task = d, digit_reward, task

    async def initial_observation(self) -> tuple[tinker.ModelInput, StopCondition]:
        return tinker.ModelInput.from_ints(list(prompt_of(self.d, self.task).encode())), [NEWLINE]

    async def step(self, action: list[int], *, extra: Any = None) -> StepResult:
        correct = float(bool(action) and is_right(self.d, action[0], self.task))
        # Optionally shaped (``digit_reward`` for another digit). Any reward for a wrong answer is shared by
        # every prompt, and the policy settles on one constant answer (right for one prompt in nine).
        digit = bool(action) and chr(action[0]).isdigit()
        return StepResult(
            reward=correct if correct else self.digit_reward * digit,
            episode_done=True,
            next_observation=tinker.ModelInput.empty(),
            next_stop_condition=[NEWLINE],
            metrics={"correct": correct},
        )


class ToyGroup(EnvGroupBuilder):
    def __init__(self, d: int, size: int, digit_reward: float = 0.0, task: str = "sum") -> None:
        self.d, self.size, self.digit_reward, self.task = d, size, digit_reward, task

    async def make_envs(self) -> Sequence[Env]:
        return [ToyEnv(self.d, self.digit_reward, self.task) for _ in range(self.size)]

    def logging_tags(self) -> list[str]:
        return ["sum"]


class ToyDataset(RLDataset):
    """Batch i: ``groups`` groups, the digits in turn from ``i * groups``."""

    def __init__(
        self,
        batches: int,
        groups: int,
        group_size: int,
        digit_reward: float = 0.0,
        prompts: int = 9,
        task: str = "sum",
    ) -> None:
        self.batches, self.groups, self.group_size = batches, groups, group_size
        self.digit_reward, self.prompts, self.task = digit_reward, prompts, task

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        start = index * self.groups
        digits = [(start + j) % self.prompts for j in range(self.groups)]
        return [ToyGroup(d, self.group_size, self.digit_reward, self.task) for d in digits]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class ToyRLBuilder(RLDatasetBuilder):
    batches: int = 200
    groups: int = 8
    group_size: int = 16
    test_group_size: int = 8
    digit_reward: float = 0.0
    prompts: int = 9
    task: str = "sum"

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        test = ToyDataset(1, self.prompts, self.test_group_size, prompts=self.prompts, task=self.task)
        train = ToyDataset(
            self.batches, self.groups, self.group_size, self.digit_reward, self.prompts, self.task
        )
        return train, test


# --------------------------------------------------------------------------------- supervised data


class ToyText(SupervisedDataset):
    def __init__(self, batches: int, batch_size: int, task: str = "case", prompts: int = 16) -> None:
        self.batches, self.batch_size, self.task, self.prompts = batches, batch_size, task, prompts

    def get_batch(self, index: int) -> list[tinker.Datum]:
        out = []
        for j in range(self.batch_size):
            d = (index * self.batch_size + j) % self.prompts
            tokens = list(f"{prompt_of(d, self.task)}{chr(answer_of(d, self.task))}\n".encode())
            out.append(
                datum_from_model_input_weights(
                    tinker.ModelInput.from_ints(tokens), torch.ones(len(tokens), dtype=torch.float32)
                )
            )
        return out

    def __len__(self) -> int:
        return self.batches


@chz.chz
class ToySLBuilder(SupervisedDatasetBuilder):
    batches: int = 40
    batch_size: int = 16
    task: str = "case"
    prompts: int = 16

    def __call__(self) -> tuple[SupervisedDataset, SupervisedDataset | None]:
        return ToyText(self.batches, self.batch_size, self.task, self.prompts), None


# ------------------------------------------------------------------------------------------- driver


def start_service(python: str, workdir: Path) -> tuple[subprocess.Popen[str], str, str]:
    """`make tinker-cpu` (rljob.local.tinker_cpu) in the project's venv: (process, URL, base model)."""
    env = {**os.environ, "PYTHONSAFEPATH": "1", "RLJOB_TINKER_API_KEYS": API_KEY}
    cmd = [python, "-m", "rljob.local.tinker_cpu", "--workdir", str(workdir / "service")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    found: dict[str, str] = {}
    for line in proc.stdout:
        key, _, value = line.strip().partition("=")
        if key in ("TINKER_BASE_URL", "TINKER_BASE_MODEL"):
            found[key] = value
        if len(found) == 2:
            return proc, found["TINKER_BASE_URL"], found["TINKER_BASE_MODEL"]
    raise SystemExit(f"tinker-cookbook: the service exited ({proc.wait()}); see {workdir}/service/*.log")


def read_metrics(log_path: Path) -> list[dict[str, Any]]:
    path = log_path / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rl_config(args: argparse.Namespace, url: str, model: str, log_path: Path, steps: int) -> Any:
    return rl_train.Config(
        log_path=str(log_path),
        model_name=model,
        recipe_name="rljob-sum",
        base_url=url,
        dataset_builder=ToyRLBuilder(
            batches=args.rl_steps,
            groups=args.groups,
            group_size=args.group_size,
            digit_reward=args.digit_reward,
            prompts=args.prompts,
            task=args.task,
        ),
        learning_rate=args.lr,
        max_tokens=1,
        lora_rank=8,
        max_steps=steps,
        save_every=args.save_every,
        eval_every=args.eval_every,
        num_groups_to_log=0,
        rollout_json_export=False,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tinker-cookbook", description=__doc__.splitlines()[0])
    p.add_argument("--service-python", default=".venv/bin/python", help="the project's venv (the service)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--base-url", default=None, help="a service already running (its key: TINKER_API_KEY)")
    p.add_argument("--rl-first", type=int, default=10, help="RL iterations before the resume")
    p.add_argument("--rl-steps", type=int, default=40, help="RL iterations in all")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--groups", type=int, default=16, help="groups per iteration (16: every prompt once)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--task", choices=["case", "sum"], default="case")
    p.add_argument("--prompts", type=int, default=16, help="how many prompts the task asks (sum: at most 9)")
    p.add_argument("--digit-reward", type=float, default=0.0, help="reward of a wrong digit (shaping)")
    p.add_argument("--sl-steps", type=int, default=30)
    p.add_argument("--want", type=float, default=0.8, help="right-answer rate of the last three iterations")
    args = p.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tinker-cookbook-"))
    workdir.mkdir(parents=True, exist_ok=True)
    proc = None
    if args.base_url:
        url, model = args.base_url, os.environ.get("TINKER_BASE_MODEL", "rljob/tiny-qwen3")
    else:
        os.environ["TINKER_API_KEY"] = API_KEY
        proc, url, model = start_service(args.service_python, workdir)
    try:
        tokenizer_utils.register_tokenizer(model, ByteTokenizer)
        rl_log = workdir / "rl"
        asyncio.run(rl_train.main(rl_config(args, url, model, rl_log, args.rl_first)))
        first = read_metrics(rl_log)
        asyncio.run(rl_train.main(rl_config(args, url, model, rl_log, args.rl_steps)))
        rows = read_metrics(rl_log)
        sl_log = workdir / "sl"
        sl_cfg = sl_train.Config(
            log_path=str(sl_log),
            model_name=model,
            recipe_name="rljob-sum-sl",
            base_url=url,
            dataset_builder=ToySLBuilder(batches=args.sl_steps, task=args.task, prompts=args.prompts),
            learning_rate=args.lr,
            lr_schedule="constant",
            lora_rank=8,
            save_every=10,
            eval_every=0,
        )
        asyncio.run(sl_train.main(sl_cfg))
        sl_rows = read_metrics(sl_log)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()

    train = [r for r in rows if "env/all/correct" in r]
    rates = [round(float(r["env/all/correct"]), 3) for r in train]
    test = [round(float(r["test/env/all/correct"]), 3) for r in rows if "test/env/all/correct" in r]
    resumed_at = train[len([r for r in first if "env/all/correct" in r])]["progress/batch"] if train else None
    nll = [round(float(r["train_mean_nll"]), 3) for r in sl_rows if "train_mean_nll" in r]
    tail = sum(rates[-3:]) / max(1, len(rates[-3:]))
    ok = {
        "starts_at_chance": bool(rates) and rates[0] <= 0.2,  # case: about 0.1 by chance
        "learns": tail >= args.want,
        "resumes_where_it_stopped": resumed_at == args.rl_first,
        "supervised_nll_halves": len(nll) >= 2 and nll[-1] <= nll[0] / 2,
    }
    print(
        json.dumps(
            {
                "rl_correct_per_iteration": rates,
                "rl_test_correct": test,
                "rl_resumed_at": resumed_at,
                "sl_nll_per_step": nll,
                "checks": ok,
                "workdir": str(workdir),
            }
        ),
        flush=True,
    )
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
