"""One RL train step at full size on the TPU compiler: rljob's programs against tunix's RL learner step and
MaxText's own RL trainer step, for a catalog recipe's model, LoRA and trainer slice, on a machine without a
TPU.

Every arm is lowered and compiled by libtpu's compiler for the recipe's trainer topology
(``jax.experimental.topologies.get_topology_desc`` devices, as rljob.trainer.compilecheck and MaxText's
``train_compile`` describe it; docs/drill.md, "rljob drill --compile"), every parameter a ShapeDtypeStruct
with its NamedSharding, no weights. The RL batch is the same for every arm: ``groupSize x groupsPerBatch``
rollouts of the recipe, seeded, prompts uniform in 256..maxPromptTokens and completions log-uniform in
256..maxTokens (bench/train_step_vs_tunix.py's spread, at the recipe's limits).

  rljob   rljob.trainer.compilecheck's ``accumulate`` and ``apply`` programs at the plan's shapes
          (``[micro_batches, microBatchSize, tokenBudget]`` packed rows); a step is as many accumulate calls
          as the packed rows need, then one apply.
  tunix   tunix 0.1.7's RL actor step (``tunix.rl.trainer.Trainer``, what ``tunix.rl.rl_cluster.RLCluster``
          trains the actor with; its jitted body ``PeftTrainer._train_step``: ``nnx.value_and_grad`` of
          ``tunix.rl.algo_core.grpo_loss_fn`` over the LoRA parameters, then the optimizer update) on the
          same MaxText model and qwix LoRA, MaxText's output head on (tunix reads ``[B, T, V]`` logits),
          as tunix's GRPO learner feeds it by default: the batch split into ``--tunix-micro-batch`` rollouts
          per call (RLTrainingConfig.training_micro_batch_size), the prompt left-padded to maxPromptTokens
          and the completion right-padded to maxTokens (tunix pads to the rollout config's lengths).
  maxtext MaxText 0.2.5's RL trainer (``maxtext.trainers.post_train.rl.train_rl``): it builds tunix's
          RLCluster and GrpoLearner around the same tunix Trainer, the MaxText model wrapped by
          ``maxtext.integration.tunix.TunixMaxTextAdapter``; its jitted program is tunix's train step with
          MaxText's RL defaults (its config's micro-batch, algorithm and packing settings).

Per arm and device: peak HBM bytes (argument + output - alias + temporaries + code + the state that stays
resident, as compilecheck counts it), FLOPs (the model's analytic count over the tokens the arm computes,
MaxText's ``calculate_tflops_training_per_device``; XLA counts a scanned loop's body once), bytes accessed
(XLA), the roofline seconds of one whole step (every call of it) and useful (non-pad) tokens per roofline
second. An arm that cannot be compiled (the compiler's out-of-memory, a partitioning error, a model that
cannot be built without weights) prints one line with the error's first line. Without libtpu: one line
saying skipped. Run (one compile at a time; minutes of CPU per program):
``.venv/bin/python bench/train_step_compiled.py [--recipe qwen3-8b-v5p] [--arms rljob,tunix,maxtext]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_step_vs_tunix as cpu_bench  # noqa: E402  (bench/ is not a package)

BENCH = "train_step_compiled"


def emit(metric: str, value: object, **kw: object) -> None:
    print(json.dumps({"bench": BENCH, "metric": metric, "value": value, **kw}), flush=True)


def run_config(recipe: str) -> Any:
    import yaml
    from rljob.recipes.plan import parse_manifest, resolve

    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "sbs"},
        "spec": {"recipe": recipe, "storage": {"root": "gs://rljob-bench"}},
    }
    return resolve(parse_manifest(yaml.safe_dump(doc)))


@dataclasses.dataclass
class Batch:
    lengths: list[tuple[int, int]]
    max_prompt: int
    max_completion: int
    vocab: int

    @property
    def useful(self) -> int:
        return sum(p + c for p, c in self.lengths)


def rl_batch(rc: Any, seed: int) -> Batch:
    alg = rc.spec.algorithm
    n = int(alg.group_size) * int(alg.groups_per_batch)
    mp, mc = int(alg.max_prompt_tokens), int(alg.max_tokens)
    lengths = cpu_bench.rollout_lengths(n, 1, seed, max_prompt=mp, max_completion=mc)
    return Batch(lengths, mp, mc, 32_000)


def arm_context(rc: Any, batch: Batch) -> dict[str, Any]:
    return {
        "recipe": rc.spec.recipe,
        "model": str(rc.trainer.maxtext.get("model_name")),
        "type": rc.trainer.tpu.type_name,
        "slices": rc.trainer.slices,
        "rollouts": len(batch.lengths),
        "useful_tokens": batch.useful,
        "longest": max(p + c for p, c in batch.lengths),
        "lora": {"rank": rc.spec.lora.rank, "targets": list(rc.spec.lora.targets)},
    }


def summary(
    programs: dict[str, dict[str, Any]], calls: dict[str, int], useful: int, resident: int = 0
) -> dict[str, Any]:
    """The step's figures from its programs' compiled figures and how many times the step calls each."""
    peak = max(int(p["peak_bytes_per_device"]) for p in programs.values())
    seconds = sum(calls[n] * float(p["roofline_seconds"]) for n, p in programs.items())
    return {
        "peak_bytes_per_device": peak + resident,
        "flops": sum(calls[n] * float(p["flops"]) for n, p in programs.items()),
        "bytes_accessed": sum(calls[n] * float(p["bytes_accessed"]) for n, p in programs.items()),
        "roofline_seconds": seconds,
        "useful_tokens_per_roofline_s": useful / seconds if seconds > 0 else 0.0,
        "calls": calls,
    }


def rljob_arm(rc: Any, batch: Batch) -> dict[str, Any]:
    from rljob.trainer import compilecheck
    from rljob.trainer.main import model_setup
    from rljob.trainer.packing import pack_rollouts

    _, step_cfg, _ = model_setup(rc, "config", None)
    rollouts = cpu_bench.make_rollouts(batch.lengths, batch.vocab, int(rc.spec.algorithm.group_size), 0)
    packed = pack_rollouts(rollouts, step_cfg.pack_config())
    rows = len(packed) * step_cfg.rows
    per_call = step_cfg.micro_batches
    calls = -(-len(packed) // per_call)
    report, _ = compilecheck.compile_run(rc, only={"accumulate", "apply"})
    progs = report["programs"]
    failed = {n: p for n, p in progs.items() if "roofline_seconds" not in p}
    out: dict[str, Any] = {
        "mesh": report["mesh"],
        "shape": report["shape"],
        "packed_rows": rows,
        "row_tokens": rows * step_cfg.budget,
        "programs": progs,
    }
    if failed:
        out["error"] = "; ".join(f"{n}: {p.get('error', 'does not fit')}" for n, p in failed.items())
        return out
    out.update(summary(progs, {"accumulate": calls, "apply": 1}, batch.useful))
    return out


ARMS = {"rljob": rljob_arm}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="qwen3-8b-v5p")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if importlib.util.find_spec("libtpu") is None:
        emit("skipped", "libtpu is not installed (the compile extra: pip install -e '.[compile]')")
        return 0
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rc = run_config(a.recipe)
    batch = rl_batch(rc, a.seed)
    ctx = arm_context(rc, batch)
    for name in a.arms.split(","):
        t0 = time.monotonic()
        try:
            fig = ARMS[name](rc, batch)
        except Exception as e:
            fig = {
                "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400] if str(e).strip() else ''}",
                "where": traceback.format_exc().splitlines()[-3].strip(),
            }
        fig["seconds"] = round(time.monotonic() - t0, 1)
        if "error" in fig:
            emit("not_compiled", fig.pop("error"), arm=name, **fig, **ctx)
            continue
        emit("step", fig["useful_tokens_per_roofline_s"], arm=name, **fig, **ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
