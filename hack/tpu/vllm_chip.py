"""vLLM's TPU engine against rljob's trainer on one chip: the step-0 parity gate on real hardware.

One process holds the chip at a time and the two sides pin different JAX builds (the trainer 0.12.0.1,
vllm-tpu 0.32.0's tpu-inference 0.11.2), so the run is three processes over one directory, in this order:

  prepare DIR  (trainer bundle) a full-size Qwen3-0.6B (28 layers, 151,936 tokens, tied head) with random
               weights of a realistic logit scale, written as Hugging Face files (config.json,
               model.safetensors); converted by rljob's own conversion (rljob.trainer.hf_weights.convert,
               MaxText's mapping); the base laid out as the trainer pod lays it out (Trainer.lay_out_base);
               two adapter versions (LoRA rank 16 on every projection): v1 random factors, v2 what rljob's
               train step made of v1 in TRAIN_STEPS GRPO steps (Trainer.train_on_packed), each published
               as the loop publishes it (policy.peft.to_peft, rljob.trainer.export.publish_adapter); the
               trainer's log-probs of fixed token rows under each version (the parity gate's scoring
               program), and how far each version moves them (``adapter_effect``: the engine's agreement
               with a version says it serves that version only where the versions differ by more).
  engine DIR   (vLLM bundle) vLLM's engine in process (vllm.LLM: this machine has no TCP socket, so no server)
               built from the argv rljob renders for the v5e example (rljob.sampler.vllm.build_command, parsed
               by vLLM's own `vllm serve` parser) and its env; loads adapter v1, scores the rows (prompt
               log-probs) and samples completions with log-probs; loads v2 under the next versioned name
               and unloads v1 (the sampler's hot-swap order, rljob.sampler.adapters), scores again; times a
               loop-sized sampling batch.
  score DIR    (trainer bundle) the trainer's log-probs of vLLM's sampled tokens: the parity gate's own
               statistic (mean |trainer - sampler| over sampled tokens, rljob.trainer.rollouts).

Figures go to DIR/figures.jsonl and, when RLJOB_TPU_FIGURES is set, there too (JSON lines: bench, metric,
value, context). What it does not cover of the sampler entrypoint: the HTTP server, the auth front and the
adapter watcher's downloads (vLLM's /v1/load_lora_adapter calls the same engine add_lora used here).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# the chip tier's fixtures (tests/fixtures): model keys and Hugging Face configs
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

MODEL = "qwen3-0.6b"
HF_ID = "Qwen/Qwen3-0.6B"
ROWS, LEN = 8, 512
RANK, ALPHA = 16, 32.0
EMBED_STD = 0.08
# v2 = v1 after this many GRPO steps of rljob's train step, at a learning rate that moves the adapter well
# past the parity gate's bound (a test of serving what the trainer trained, not of learning).
TRAIN_STEPS, TRAIN_LR, TRAIN_ROWS = 3, 3e-3, 2
# A dry run off the chip: RLJOB_VLLM_CHIP_CPU=1 takes 2 layers and dot-product attention (Splash is TPU-only).
CPU_DRY_RUN = os.environ.get("RLJOB_VLLM_CHIP_CPU") == "1"


def _keys() -> dict[str, Any]:
    from fixtures.chip_models import fullsize_keys

    if CPU_DRY_RUN:
        return fullsize_keys(MODEL, budget=LEN, depth=2, attention="dot_product", dtype="float32")
    return fullsize_keys(
        MODEL, budget=LEN
    )  # tied head: logits' std about EMBED_STD * sqrt(1024) = 2.6 nats, a trained model's spread


def emit(directory: Path, metric: str, value: Any, **context: Any) -> None:
    line = json.dumps({"bench": "vllm_chip", "metric": metric, "value": value, "context": context})
    print(line, flush=True)
    for path in (directory / "figures.jsonl", os.environ.get("RLJOB_TPU_FIGURES")):
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")


def _policy(directory: Path) -> Any:
    from rljob.trainer.model import ModelSpec, Policy

    return Policy(
        ModelSpec(
            maxtext=_keys(),
            lora_rank=RANK,
            lora_alpha=ALPHA,
            checkpoint=str(directory / "mt" / "0" / "items"),
        )
    )


def _scores(policy: Any, lora: Any, tokens: np.ndarray) -> np.ndarray:
    scored = policy.scoring_program()
    pos = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    seg = np.ones_like(tokens)
    return np.asarray(scored(policy.base, lora, tokens, pos, seg), np.float32)


def prepare(directory: Path) -> None:
    import jax
    from fixtures.hf_models import qwen3_config
    from rljob.trainer import hf_weights
    from rljob.trainer.model import maxtext_config
    from safetensors.numpy import save_file

    cfg = maxtext_config(_keys())
    tied = bool(cfg.logits_via_embedding)
    hf_cfg = qwen3_config(
        cfg,
        max_position_embeddings=40960,
        tie_word_embeddings=tied,
        dtype="bfloat16",
        architectures=["Qwen3ForCausalLM"],
    )
    hf = directory / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    hf_cfg.save_pretrained(str(hf))
    from maxtext.checkpoint_conversion.utils.hf_shape import QWEN_HF_WEIGHTS_TO_SHAPE

    rng = np.random.default_rng(0)
    tensors = {}
    for name, shape in QWEN_HF_WEIGHTS_TO_SHAPE(hf_cfg.to_dict()).items():
        if tied and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            t = 1.0 + 0.05 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            t = EMBED_STD * rng.standard_normal(shape)
        else:
            t = rng.standard_normal(shape) / np.sqrt(shape[-1])
        tensors[name] = t.astype(np.float32).astype(jax.numpy.bfloat16)
    save_file({k: np.asarray(v) for k, v in tensors.items()}, str(hf / "model.safetensors"))
    t0 = time.monotonic()
    n = hf_weights.convert(
        hf, str(directory / "mt"), cfg, label=HF_ID, report=print, scratch=directory / "scratch"
    )
    emit(directory, "conversion_s", round(time.monotonic() - t0, 1), tensors=n, model=MODEL)

    import pickle

    from rljob.trainer.export import publish_adapter

    policy = _policy(directory)
    trainer = _trainer(policy)
    trainer.lay_out_base()  # as the trainer pod does before anything reads the base
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, int(cfg.vocab_size), (ROWS, LEN), dtype=np.int32)
    np.save(directory / "tokens.npy", tokens)
    base = _scores(policy, policy.zero_lora(policy.lora0), tokens)
    np.save(directory / "trainer_base.npy", base)
    emit(directory, "trainer_mean_token_logprob", round(float(base[:, 1:].mean()), 3), model=MODEL)
    v1 = jax.tree.map(
        lambda x: x + 0.02 * jax.random.normal(jax.random.key(100 + x.size % 97), x.shape, x.dtype),
        policy.lora0,
    )
    versions = {1: v1, 2: _trained(policy, trainer, v1)}
    scores = {0: base}
    for version, lora in versions.items():
        publish_adapter(str(directory / "adapters"), version, policy.peft.to_peft(lora), policy.peft.config())
        scores[version] = _scores(policy, lora, tokens)
        np.save(directory / f"trainer_v{version}.npy", scores[version])
        with open(directory / f"lora_v{version}.pkl", "wb") as f:
            pickle.dump(jax.tree.map(np.asarray, lora), f)
    emit(directory, "adapter_effect", _effects(scores), side="trainer", steps=TRAIN_STEPS, lr=TRAIN_LR)


def _effects(scores: dict[int, np.ndarray]) -> dict[str, float]:
    """Mean |log-prob change| from each version to the one before (0: the base), the first token left out
    as the comparisons leave it out."""
    return {
        f"v{v}_vs_{'base' if v == 1 else f'v{v - 1}'}": float(np.abs(scores[v] - scores[v - 1])[:, 1:].mean())
        for v in sorted(scores)
        if v > 0
    }


def _trainer(policy: Any) -> Any:
    from rljob.trainer.train_step import StepConfig, Trainer

    return Trainer(
        policy,
        StepConfig(
            budget=LEN,
            rows=TRAIN_ROWS,
            micro_batches=1,
            learning_rate=TRAIN_LR,
            grad_dtype="float32",
            mu_dtype="float32",
        ),
    )


def _trained(policy: Any, trainer: Any, lora: Any) -> Any:
    """``lora`` after TRAIN_STEPS GRPO steps of rljob's train step on random rollouts, each batch's old
    log-probs scored by the parity gate's program under the adapter being trained (on-policy)."""
    import jax.numpy as jnp
    from fixtures.chip_models import lengths_for, rollouts
    from rljob.trainer.packing import PackConfig, pack_rollouts

    scored = policy.scoring_program()
    state = trainer.init_state(lora)
    for step in range(TRAIN_STEPS):
        rs = rollouts(policy.vocab_size, lengths_for(LEN, TRAIN_ROWS, seed=step), seed=step)
        for r in rs:
            r.per_token["old_logprobs"] = np.zeros(np.size(r.completion_ids), np.float32)
        packed = pack_rollouts(rs, PackConfig(budget=LEN, rows=TRAIN_ROWS))
        for mb in packed:
            args = (jnp.asarray(a) for a in (mb.tokens, mb.positions, mb.segment_ids))
            mb.fields["old_logprobs"] = np.asarray(scored(policy.base, state.lora, *args), np.float32)
        state, metrics = trainer.train_on_packed(state, packed)
        assert np.isfinite(metrics["loss"]) and metrics["update_skipped"] == 0, metrics
    return state.lora  # as the loop exports it (rljob.trainer.runtime: to_peft(state.lora))


def engine(directory: Path) -> None:
    # The env rljob's sampler sets before `vllm serve`, and in-process engine settings for a machine without
    # TCP (vLLM's engine core in this process: no ZMQ between processes).
    from rljob.recipes.runconfig import SAMPLED_LOGPROBS
    from rljob.sampler.vllm import build_command

    rc = _run_config()
    cmd = build_command(rc)
    os.environ.update(cmd.env)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if os.environ.get("RLJOB_VLLM_NO_TCP") == "1":
        _no_tcp_process_groups()
    import dataclasses

    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.lora.request import LoRARequest
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = list(cmd.argv[2:])
    argv[0] = str(directory / "hf")  # the model: rljob's weights on local disk (the sampler restores them so)
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(argv)
    ea = EngineArgs.from_cli_args(args)
    # Exactly the engine settings rljob's flags set (server flags such as --host are not the engine's).
    fields = {f.name for f in dataclasses.fields(ea)}
    dests = [a[2:].replace("-", "_") for a in argv if a.startswith("--")]
    kwargs = {d: getattr(ea, d) for d in dests if d in fields and d != "model"}
    kwargs["skip_tokenizer_init"] = True  # token ids in, token ids out: the files have no tokenizer
    # Scoring prompts (prompt_logprobs) materializes [tokens, vocab] logits (1.16 GiB in bf16 for 8 x 512
    # tokens), which the sampler's own traffic never does; at vLLM's default 0.92 the KV cache leaves 120 MiB
    # for it (seen on the v5e chip).
    kwargs["gpu_memory_utilization"] = 0.8
    emit(directory, "engine_args", {k: str(v) for k, v in sorted(kwargs.items())}, argv=" ".join(cmd.argv))
    t0 = time.monotonic()
    llm = LLM(model=str(directory / "hf"), **kwargs)
    emit(directory, "engine_start_s", round(time.monotonic() - t0, 1))
    tokens = np.load(directory / "tokens.npy")
    prompts = [{"prompt_token_ids": row.tolist()} for row in tokens]
    score = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)

    def prompt_logprobs(req: Any) -> np.ndarray:
        # one row at a time: a row's [512, vocab] float32 logits are 0.3 GiB, the batch's 2.3 GiB (seen: OOM)
        outs = [llm.generate([p], score, lora_request=req, use_tqdm=False)[0] for p in prompts]
        got = np.zeros(tokens.shape, np.float32)
        for i, out in enumerate(outs):
            for j, entry in enumerate(out.prompt_logprobs or []):
                if entry is not None:
                    got[i, j] = entry[int(tokens[i, j])].logprob
        return got

    def compare(name: str, got: np.ndarray, want: np.ndarray) -> None:
        d = np.abs(got[:, 1:] - want[:, 1:])
        emit(
            directory,
            f"prompt_logprob_diff_{name}",
            {"mean": float(d.mean()), "max": float(d.max())},
            rows=ROWS,
            tokens=LEN,
            dtype="bfloat16",
        )

    served = {0: prompt_logprobs(None)}
    compare("base", served[0], np.load(directory / "trainer_base.npy"))
    adapters = directory / "adapters"
    v1 = LoRARequest("rljob-v1", 1, str(adapters / "v1"))
    served[1] = prompt_logprobs(v1)
    compare("v1", served[1], np.load(directory / "trainer_v1.npy"))
    # Sampled tokens with their log-probs under v1: what the parity gate compares at step 0.
    # logprobs as the trainer asks for them (tpu-inference answers none for 0: recipes/runconfig.py)
    sample = SamplingParams(
        max_tokens=128, temperature=1.0, logprobs=SAMPLED_LOGPROBS, detokenize=False, ignore_eos=True
    )
    outs = llm.generate(
        [{"prompt_token_ids": row[:64].tolist()} for row in tokens], sample, lora_request=v1, use_tqdm=False
    )
    seqs, lps = [], []
    for out in outs:
        c = out.outputs[0]
        seqs.append(list(c.token_ids))
        assert len(c.logprobs or []) == len(seqs[-1]), (len(c.logprobs or []), len(seqs[-1]))
        lps.append([d[t].logprob for d, t in zip(c.logprobs or [], seqs[-1], strict=True)])
    width = min(len(s) for s in seqs)
    seqs, lps = [s[:width] for s in seqs], [lp[:width] for lp in lps]
    np.save(directory / "sampled.npy", np.array(seqs, np.int32))
    np.save(directory / "sampled_logprobs.npy", np.array(lps, np.float32))
    # The hot-swap as the sampler does it: load the next version under its name, then unload the previous.
    t0 = time.monotonic()
    v2 = LoRARequest("rljob-v2", 2, str(adapters / "v2"))
    assert llm.llm_engine.add_lora(v2)
    assert llm.llm_engine.remove_lora(1)
    emit(directory, "hot_swap_s", round(time.monotonic() - t0, 3), loaded=sorted(llm.llm_engine.list_loras()))
    served[2] = prompt_logprobs(v2)
    compare("v2", served[2], np.load(directory / "trainer_v2.npy"))
    emit(directory, "adapter_effect_engine", _effects(served), side="engine")
    # Throughput of a loop-like batch: 32 prompts of 256 tokens, 128 new tokens each, adapter v2; the same
    # batch once before, so that the timed one compiles nothing (SKIP_JAX_PRECOMPILE compiles on first use).
    batch = [{"prompt_token_ids": tokens[i % ROWS, :256].tolist()} for i in range(32)]
    gen = SamplingParams(max_tokens=128, temperature=1.0, detokenize=False, ignore_eos=True)
    llm.generate(batch, gen, lora_request=v2, use_tqdm=False)
    t0 = time.monotonic()
    outs = llm.generate(batch, gen, lora_request=v2, use_tqdm=False)
    dt = time.monotonic() - t0
    new = sum(len(o.outputs[0].token_ids) for o in outs)
    emit(
        directory,
        "sampling_tokens_per_s",
        round(new / dt, 1),
        prompts=32,
        prompt_len=256,
        new_tokens=new,
        seconds=round(dt, 2),
        lora="rank 16, every projection",
        model=MODEL,
    )


def _no_tcp_process_groups() -> None:
    """A machine with no TCP socket cannot open gloo's one-process group (vLLM's world of 1: it binds
    127.0.0.1 all the same): torch's own in-process "fake" backend takes its place. Collectives over a world
    of one are identities, so the engine computes what it would with gloo; a TPU VM or a GKE pod has TCP and
    never takes this path."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    real_init, real_new = dist.init_process_group, dist.new_group

    def init(*_: Any, **kw: Any) -> Any:
        kw.pop("init_method", None)
        kw.update(backend="fake", store=FakeStore(), world_size=1, rank=0)
        return real_init(**kw)

    def new(*a: Any, **kw: Any) -> Any:
        kw["backend"] = "fake"
        return real_new(*a, **kw)

    dist.init_process_group, dist.new_group = init, new


def score(directory: Path) -> None:
    import pickle

    import jax
    from rljob.recipes.quantization import BF16_PARITY_NATS

    policy = _policy(directory)
    with open(directory / "lora_v1.pkl", "rb") as f:
        lora = jax.tree.map(jax.numpy.asarray, pickle.load(f))
    lora = jax.tree.map(lambda a, b: jax.numpy.asarray(a, b.dtype), lora, policy.lora0)
    tokens = np.load(directory / "tokens.npy")[:, :64]
    sampled = np.load(directory / "sampled.npy")
    rows = np.concatenate([tokens, sampled], axis=1)
    pad = LEN - rows.shape[1]
    rows = np.pad(rows, ((0, 0), (0, pad)))
    mine = _scores(policy, lora, rows)[:, 64 : 64 + sampled.shape[1]]
    theirs = np.load(directory / "sampled_logprobs.npy")
    d = np.abs(mine - theirs)
    emit(
        directory,
        "parity_gate_mean_abs_logprob_diff",
        float(d.mean()),
        max=float(d.max()),
        tokens=int(d.size),
        threshold=BF16_PARITY_NATS,
        adapter="v1",
        dtype="bfloat16",
    )


def _run_config() -> Any:
    import yaml
    from rljob.recipes.api import RLJob
    from rljob.recipes.plan import resolve

    root = Path(__file__).resolve().parents[2]
    doc = yaml.safe_load((root / "examples" / "qwen3-0.6b-v5e-1.yaml").read_text())
    return resolve(RLJob.model_validate_json(json.dumps(doc), strict=True))


if __name__ == "__main__":
    {"prepare": prepare, "engine": engine, "score": score}[sys.argv[1]](Path(sys.argv[2]))
