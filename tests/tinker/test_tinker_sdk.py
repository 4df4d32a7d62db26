"""The Tinker service driven by the official `tinker` SDK, unmodified, against a make-tinker-cpu-style
service: the CPU sampler and the service over the tiny model (toy 32-token vocabulary), storage on the GCS
emulator.

Each verb; forward_backward's loss and gradient against the loop mode's in-process step on the same batch;
two training clients that do not disturb each other; what the server does not support fails with the
SDK's own error (RequestFailedError), at once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.jax

import tinker  # noqa: E402
from fixtures.tinker import API_KEY, Served, serve_tinker, tinker_run_config  # noqa: E402
from tinker import types  # noqa: E402


@pytest.fixture(scope="module")
def served(gcs_emulator: Any, cpu_policy: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = f"gs://{gcs_emulator.new_bucket('tinker')}"
    progress = tmp_path_factory.mktemp("tinker") / "progress.json"

    def rc(port: int) -> Any:
        # Two keys share the pool (each may hold half: docs/tinker.md, "Limits"); API_KEY's tests hold
        # more than 8 clients at once in one ServiceClient's session.
        return tinker_run_config(root, port, progress, service={"maxTrainingClients": 32})

    with serve_tinker(rc, cpu_policy) as s:
        yield s


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[Any]:
    # Closed before the service stops: an open ServiceClient keeps sending session heartbeats (every 10 s)
    # from its own thread, and logs their failures long after the service is gone.
    with tinker.ServiceClient(base_url=served.url, api_key=API_KEY) as c:
        yield c


def datum(prompt: list[int], completion: list[int], **inputs: list[float]) -> Any:
    """A Tinker datum of prompt + completion in the next-token layout (weights 0 on the prompt)."""
    seq = prompt + completion
    n = len(seq) - 1
    loss_inputs: dict[str, Any] = {"target_tokens": seq[1:]}
    for k, v in inputs.items():
        loss_inputs[k] = [0.0] * (len(prompt) - 1) + list(v)
        assert len(loss_inputs[k]) == n
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=loss_inputs)


def lp_of(out: Any) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].data, np.float32) for o in out.loss_fn_outputs]


PROBE = [datum([1, 5, 17], [6, 9, 9]), datum([1, 4, 20, 3], [5])]


def probe(tc: Any) -> list[np.ndarray]:
    return lp_of(tc.forward(PROBE, "cross_entropy").result())


# ---------------------------------------------------------------------------------------------- verbs


def test_capabilities(served: Served) -> None:
    caps = tinker.RestClient(base_url=served.url, api_key=API_KEY).get_server_capabilities().result()
    (model,) = caps.supported_models
    assert model.model_name == served.service.cfg.base_model == "rljob/tiny-qwen3"
    assert model.trainable and model.sampleable and model.max_context_length == 32


def test_each_verb(served: Served, client: Any) -> None:
    base = served.service.cfg.base_model
    tc = client.create_lora_training_client(base_model=base, rank=8, seed=3).result()
    info = tc.get_info()
    assert (info.lora_rank, info.is_lora, info.model_data.model_name) == (8, True, base)

    batch = [datum([1, 5, 17], [6], weights=[1.0]), datum([1, 6, 18, 2], [7, 3], weights=[1.0, 0.5])]
    fwd = tc.forward(batch, "cross_entropy").result()
    fb = tc.forward_backward(batch, "cross_entropy").result()
    # forward and forward_backward score the same tokens; cross_entropy is -sum(weights * logprobs)
    for a, b in zip(lp_of(fwd), lp_of(fb), strict=True):
        np.testing.assert_array_equal(a, b)
    w = [np.asarray(d.loss_fn_inputs["weights"].data, np.float32) for d in batch]
    want = -sum(float((wi * lp).sum()) for wi, lp in zip(w, lp_of(fb), strict=True))
    assert fb.metrics["loss:sum"] == pytest.approx(want, rel=1e-6)
    assert [len(x) for x in lp_of(fb)] == [3, 5]
    np.testing.assert_allclose(
        fb.loss_fn_outputs[1]["elementwise_loss"].data, -w[1] * lp_of(fb)[1], rtol=1e-6
    )

    before = probe(tc)
    res = tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    assert (
        res.metrics["optim/step"] == 1
        and res.metrics["optim/update_skipped"] == 0
        and res.metrics["optim/grad_norm"] > 0
    )
    after = probe(tc)
    assert not np.allclose(before[0], after[0])
    # the trained targets became likelier
    assert lp_of(tc.forward(batch, "cross_entropy").result())[0][-1] > lp_of(fwd)[0][-1]

    # sampler weights by name, then a sampling client from their path
    saved = tc.save_weights_for_sampler("after-one").result()
    assert saved.path == f"tinker://{tc.model_id}/sampler_weights/after-one"
    sc = client.create_sampling_client(model_path=saved.path).result()
    prompt = types.ModelInput.from_ints([1, 5, 17, 6, 9])
    res = sc.sample(prompt, 4, types.SamplingParams(max_tokens=1, temperature=1.0, seed=7)).result()
    assert len(res.sequences) == 4
    for seq in res.sequences:
        assert len(seq.tokens) == 1 and len(seq.logprobs) == 1 and seq.stop_reason == "length"
        assert seq.sequence_id
    # the sampler's log-prob of a sampled token is the trainer's (same weights, same numerics)
    tok = res.sequences[0].tokens[0]
    trainer_lp = lp_of(tc.forward([datum([1, 5, 17, 6, 9], [tok])], "cross_entropy").result())[0][-1]
    assert res.sequences[0].logprobs[0] == pytest.approx(trainer_lp, abs=1e-4)

    # compute_logprobs: the prompt's log-probs (None first), equal to forward's on the same weights
    lps = sc.compute_logprobs(prompt).result()
    assert lps[0] is None
    np.testing.assert_allclose(lps[1:], probe(tc)[0][:4], rtol=1e-5, atol=1e-6)

    # save_weights_and_get_sampling_client: an ephemeral sampler of the current weights
    sc2 = tc.save_weights_and_get_sampling_client().result()
    greedy = sc2.sample(prompt, 2, types.SamplingParams(max_tokens=1, temperature=0.0)).result()
    assert greedy.sequences[0].tokens == greedy.sequences[1].tokens

    # save_state, and a new training client from it (with the optimizer state) is the same model
    state = tc.save_state("ckpt-1").result()
    assert state.path == f"tinker://{tc.model_id}/weights/ckpt-1"
    tc2 = client.create_training_client_from_state_with_optimizer(state.path).result()
    assert tc2.model_id != tc.model_id and tc2.get_info().lora_rank == 8
    for a, b in zip(probe(tc), probe(tc2), strict=True):
        np.testing.assert_array_equal(a, b)
    # ... and both take the same next step
    for c in (tc, tc2):
        c.forward_backward(batch, "cross_entropy").result()
        c.optim_step(types.AdamParams(learning_rate=0.05)).result()
    for a, b in zip(probe(tc), probe(tc2), strict=True):
        np.testing.assert_array_equal(a, b)
    # weights only: the same parameters, fresh Adam moments (its next step differs from tc's)
    tc3 = client.create_training_client_from_state(state.path).result()
    assert tc3.get_info().lora_rank == 8
    # a named checkpoint is not overwritten by accident
    with pytest.raises(tinker.RequestFailedError, match="exists"):
        tc.save_state("ckpt-1").result()


def test_rl_losses(served: Served, client: Any) -> None:
    tc = client.create_lora_training_client(base_model=served.service.cfg.base_model, rank=8, seed=4).result()
    lp = lp_of(tc.forward(PROBE, "cross_entropy").result())
    old = [x - 0.1 for x in lp]  # the sampler's log-probs, a little off
    adv = [1.0, -0.5]
    data = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "logprobs": old[i].tolist(),
                "advantages": [adv[i]] * len(old[i]),
            },
        )
        for i, d in enumerate(PROBE)
    ]
    out = tc.forward(data, "importance_sampling").result()
    ratio = [np.exp(a - b) for a, b in zip(lp, old, strict=True)]
    want = -sum(float((r * a).sum()) for r, a in zip(ratio, adv, strict=True))
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-5)
    # ppo with thresholds 0.95 / 1.05: ratio exp(0.1) = 1.105 is clipped
    out = tc.forward(data, "ppo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}).result()
    want = -sum(
        float(np.minimum(r * a, np.clip(r, 0.95, 1.05) * a).sum()) for r, a in zip(ratio, adv, strict=True)
    )
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-5)
    # forward_backward with ppo: the same loss as forward, and a gradient to step on
    fb = tc.forward_backward(data, "ppo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}).result()
    assert fb.metrics["loss:sum"] == pytest.approx(want, rel=1e-5)
    res = tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
    assert res.metrics["optim/grad_norm"] > 0 and res.metrics["optim/update_skipped"] == 0


# ------------------------------------------------------------------------ optimizer and saved state


def _adamw_step(p: np.ndarray, g: np.ndarray, k: np.ndarray, scale: float, hp: Any) -> np.ndarray:
    """torch.optim.AdamW's first update of ``p`` (zero moments) on gradient ``g * scale``, in numpy; masked
    entries (``k`` 0) stay as they are."""
    g = (g * k * scale).astype(np.float64)
    m, v = (1 - hp.beta1) * g, (1 - hp.beta2) * g * g
    m_hat, v_hat = m / (1 - hp.beta1), v / (1 - hp.beta2)
    new = p * (1 - hp.learning_rate * hp.weight_decay) - hp.learning_rate * m_hat / (np.sqrt(v_hat) + hp.eps)
    return np.where(k != 0, new, p)


def test_optim_step_applies_every_adam_parameter_and_load_state_restores(served: Served, client: Any) -> None:
    """optim_step with every AdamParams field (betas, eps, weight decay, gradient clipping) is torch's
    AdamW update; load_state / load_state_with_optimizer on a live client restore a save_state."""
    base = served.service.cfg.base_model
    tc = client.create_lora_training_client(base_model=base, rank=8, seed=21).result()
    m = served.service.engine.models[tc.model_id]
    batch = [datum([1, 5, 17], [6, 9], weights=[1.0, 1.0]), datum([1, 4, 20, 3], [5], weights=[1.0])]
    tc.forward_backward(batch, "cross_entropy").result()
    p0, g0, k0 = (
        [np.asarray(x, np.float64) for x in jax.tree.leaves(jax.device_get(t))]
        for t in (m.lora, m.grads, m.mask)
    )
    norm = float(np.sqrt(sum(float(np.sum((g * k) ** 2)) for g, k in zip(g0, k0, strict=True))))
    trained = sum(int(k.sum()) for k in k0)
    assert norm > 0
    # eps near a typical gradient entry, so that the clipping's scale shows in Adam's first update
    hp = types.AdamParams(
        learning_rate=0.02,
        beta1=0.8,
        beta2=0.9,
        eps=norm / np.sqrt(trained),
        weight_decay=0.3,
        grad_clip_norm=norm / 4,
    )
    res = tc.optim_step(hp).result()
    assert res.metrics["optim/grad_norm"] == pytest.approx(norm, rel=1e-5)  # the norm before clipping
    scale = hp.grad_clip_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_
    got = [np.asarray(x, np.float64) for x in jax.tree.leaves(jax.device_get(m.lora))]
    moved = 0
    for p, g, k, q in zip(p0, g0, k0, got, strict=True):
        np.testing.assert_allclose(q, _adamw_step(p, g, k, scale, hp), rtol=1e-5, atol=1e-7)
        moved += int((q != p).sum())
    assert moved > 0
    # the reference without clipping, or without weight decay, is another update: both reached the step
    no_clip = [_adamw_step(p, g, k, 1.0, hp) for p, g, k in zip(p0, g0, k0, strict=True)]
    no_decay = [
        _adamw_step(p, g, k, scale, hp.model_copy(update={"weight_decay": 0.0}))
        for p, g, k in zip(p0, g0, k0, strict=True)
    ]
    for other in (no_clip, no_decay):
        assert max(float(np.abs(q - o).max()) for q, o in zip(got, other, strict=True)) > 1e-4

    # load_state (weights) and load_state_with_optimizer (weights and Adam moments) on a live client
    path = tc.save_state("adam-1").result().path
    at_save = probe(tc)
    step = types.AdamParams(learning_rate=0.05)
    tc.forward_backward(batch, "cross_entropy").result()
    tc.optim_step(step).result()
    after_two = probe(tc)
    assert not np.allclose(after_two[0], at_save[0])
    with pytest.warns(FutureWarning):  # the SDK deprecates it in favour of create_training_client_from_state
        tc.load_state_with_optimizer(path).result()
    for a, b in zip(probe(tc), at_save, strict=True):
        np.testing.assert_array_equal(a, b)
    # a restart would restore the loaded state: it is the client's newest automatic checkpoint
    from rljob.common.storage import join
    from rljob.trainer.tinker.server import _key

    svc = served.service
    tree, meta = svc._restore_state(join(svc.cfg.checkpoints, "tinker", _key(tc.model_id), "auto"))
    assert meta["optim_steps"] == 1
    saved, live = jax.tree.leaves(jax.device_get(tree["lora"])), jax.tree.leaves(jax.device_get(m.lora))
    for a, b in zip(saved, live, strict=True):
        np.testing.assert_array_equal(a, b)
    tc.forward_backward(batch, "cross_entropy").result()
    tc.optim_step(step).result()
    for a, b in zip(probe(tc), after_two, strict=True):
        np.testing.assert_array_equal(a, b)  # the same second step: the moments came back too
    with pytest.warns(FutureWarning):
        tc.load_state(path).result()
    for a, b in zip(probe(tc), at_save, strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(jax.device_get(m.count)) == 0 and not any(
        np.asarray(x).any() for x in jax.tree.leaves(jax.device_get(m.mu))
    )  # weights only: fresh Adam moments


def test_session_heartbeats_and_close(served: Served) -> None:
    """The SDK's session heartbeats (every 10 s) keep its session alive on the service; closing the
    ServiceClient ends the session and frees its training clients."""
    svc = served.service
    batches = svc.telemetry_batches
    own = tinker.ServiceClient(base_url=served.url, api_key=API_KEY)
    tc = own.create_lora_training_client(base_model=svc.cfg.base_model, rank=4, seed=31).result()
    sid = own.holder.get_session_id()
    assert svc.model_session[tc.model_id] == sid and tc.model_id in svc.engine.models
    seen = svc.sessions[sid]
    deadline = time.monotonic() + 60
    while svc.sessions[sid] == seen and time.monotonic() < deadline:
        time.sleep(0.5)
    assert svc.sessions[sid] > seen, "no heartbeat reached the service"
    own.close("success").result()
    deadline = time.monotonic() + 60
    while tc.model_id in svc.engine.models and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sid not in svc.sessions and sid in svc.finished
    assert svc.telemetry_batches > batches  # close drains the SDK's telemetry to the service, accepted
    assert tc.model_id not in svc.engine.models and tc.model_id not in svc.model_session


# --------------------------------------------------------------------------------- the in-process step


def test_forward_backward_equals_the_in_process_train_step(served: Served, client: Any) -> None:
    """The SDK's forward_backward (importance_sampling) computes the loss and gradient the loop mode's
    compiled step computes on the same rollouts (rljob.trainer.train_step.Trainer)."""
    from rljob.trainer.packing import Rollout
    from rljob.trainer.train_step import Trainer

    tc = client.create_lora_training_client(base_model=served.service.cfg.base_model, rank=8, seed=5).result()
    rng = np.random.default_rng(0)
    rollouts, data = [], []
    for _ in range(80):  # more rows than one compiled call holds: several accumulate calls
        prompt = [1, *rng.integers(2, 32, rng.integers(1, 5)).tolist()]
        comp = rng.integers(2, 32, rng.integers(1, 8)).tolist()
        old = (-np.log(32) + 0.3 * rng.standard_normal(len(comp))).astype(np.float32)
        adv = float(rng.standard_normal())
        ones = np.ones(len(comp), np.float32)
        rollouts.append(Rollout(prompt, comp, adv, per_token={"old_logprobs": old, "loss_weight": ones}))
        data.append(datum(prompt, comp, logprobs=old.tolist(), advantages=[adv] * len(comp)))
    fb = tc.forward_backward(data, "importance_sampling").result()

    svc = served.service
    model = svc.engine.models[tc.model_id]
    got = jax.device_get(model.grads)
    trainer = Trainer(svc.engine.policy, svc.engine.cfg)
    from rljob.trainer.packing import pack_rollouts
    from rljob.trainer.train_step import stack_micro_batches

    packed = pack_rollouts(rollouts, trainer.cfg.pack_config())
    acc = trainer.zero_acc(model.lora)
    for call in stack_micro_batches(packed, trainer.cfg.micro_batches):
        acc = trainer.accumulate(acc, model.lora, trainer.policy.base, trainer.device_batch(call))
    want_grads, metrics = jax.device_get(acc)
    assert len(packed) > trainer.cfg.micro_batches  # the request took several compiled calls
    assert fb.metrics["loss:sum"] == pytest.approx(float(metrics["loss"]), rel=1e-5)
    flat_got, flat_want = jax.tree.leaves(got), jax.tree.leaves(want_grads)
    num = sum(
        float(np.sum((np.asarray(a) - np.asarray(b)) ** 2)) for a, b in zip(flat_got, flat_want, strict=True)
    )
    den = sum(float(np.sum(np.asarray(b) ** 2)) for b in flat_want)
    assert den > 0
    assert np.sqrt(num / den) <= 1e-5
    tc.optim_step(types.AdamParams(learning_rate=0.0)).result()  # clears the buffer


# ------------------------------------------------------------------------------------- many adapters


def test_two_training_clients_do_not_disturb_each_other(served: Served, client: Any) -> None:
    base = served.service.cfg.base_model
    a = client.create_lora_training_client(base_model=base, rank=8, seed=11).result()
    b = client.create_lora_training_client(base_model=base, rank=4, seed=12, train_mlp=False).result()
    assert b.get_info().lora_rank == 4
    b0 = probe(b)
    batch = [datum([1, 5, 17], [6], weights=[1.0])]
    for _ in range(3):
        a.forward_backward(batch, "cross_entropy")
        a.optim_step(types.AdamParams(learning_rate=0.05))
    a1 = probe(a)
    for x, y in zip(b0, probe(b), strict=True):
        np.testing.assert_array_equal(x, y)  # b untouched by a's training
    # interleaved, in flight at once: each client's requests run in its own order on its own adapter
    futs = []
    for _ in range(2):
        futs += [
            b.forward_backward(batch, "cross_entropy"),
            b.optim_step(types.AdamParams(learning_rate=0.05)),
        ]
    for f in futs:
        f.result()
    for x, y in zip(a1, probe(a), strict=True):
        np.testing.assert_array_equal(x, y)  # a untouched by b's training
    # b trained rank 4, attention only: its other factors stayed exactly zero
    eng = served.service.engine
    mb = eng.models[b.model_id]
    for leaf, (module, which) in zip(
        jax.tree.leaves(jax.device_get(mb.lora)), eng.policy.peft.lora_paths(), strict=True
    ):
        arr = np.asarray(leaf)
        if module in ("wi_0", "wi_1", "wo"):
            assert not arr.any()
        elif which == "a":
            assert not arr[..., 4:].any() and arr[..., :4].any()
        else:
            assert not arr[4:].any() and arr[:4].any()
    # both adapters served by the samplers at once, each its own weights
    sa, sb = (
        a.save_weights_and_get_sampling_client().result(),
        b.save_weights_and_get_sampling_client().result(),
    )
    p = types.ModelInput.from_ints([1, 5, 17, 6])
    la, lb = sa.compute_logprobs(p).result(), sb.compute_logprobs(p).result()
    np.testing.assert_allclose(la[1:], probe(a)[0][:3], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lb[1:], probe(b)[0][:3], rtol=1e-5, atol=1e-6)
    ra = sa.sample(p, 1, types.SamplingParams(max_tokens=1, temperature=0.0)).result().sequences[0]
    rb = sb.sample(p, 1, types.SamplingParams(max_tokens=1, temperature=0.0)).result().sequences[0]
    ta = lp_of(a.forward([datum([1, 5, 17, 6], ra.tokens)], "cross_entropy").result())[0][-1]
    tb = lp_of(b.forward([datum([1, 5, 17, 6], rb.tokens)], "cross_entropy").result())[0][-1]
    assert ra.logprobs[0] == pytest.approx(ta, abs=1e-4) and rb.logprobs[0] == pytest.approx(tb, abs=1e-4)
    assert len(served.sampler.adapters) >= 2


# ------------------------------------------------------------------------------------ provenance spans


def _spanned(d: Any, skew: int = 0, sid: str = "seq-0") -> Any:
    """``d`` with provenance as the SDK's Datum carries it (a prompt run, then a sampled run) over its model
    input and its targets; ``skew`` > 0 makes the runs cover that many positions too many (the SDK's
    ``with_provenance`` would refuse them; a Datum built directly does not)."""
    n = d.model_input.length
    spans = [
        types.PromptProvenanceSpan(sequence_id=sid, offset=0, length=1),
        types.SampledProvenanceSpan(sequence_id=sid, length=n - 1 + skew),
    ]
    return dataclasses.replace(d, model_input_spans=spans, loss_fn_input_spans=spans)


_MISCOVERED = (
    r"data\[0\]\.model_input_spans: the runs cover 3 positions, the field has 2; "
    r"data\[0\]\.loss_fn_input_spans: the runs cover 3 positions, the field has 2"
)


def test_provenance_spans_are_accepted_and_change_nothing(served: Served, client: Any) -> None:
    """Datums with provenance as the Cookbook (0.6.x) builds them from a real sample: the spans name the
    sample's sequence id, tile the input and the targets, and change neither the loss nor the log-probs."""
    tc = _shared_client(served, client)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = [1, 5, 17]
    params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=11)
    (seq,) = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences
    assert seq.sequence_id and len(seq.tokens) == 3
    tokens, lps = list(seq.tokens), list(seq.logprobs)
    plain = datum(prompt, tokens, logprobs=lps, advantages=[1.0, -0.5, 2.0])
    sid = seq.sequence_id
    spanned = plain.with_provenance(  # the SDK checks the tiling here; the service checks it again
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=0, length=3),
            types.SampledProvenanceSpan(sequence_id=sid, length=2),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=2),
            types.SampledProvenanceSpan(sequence_id=sid, length=3),
        ],
    )
    for loss in ("importance_sampling", "ppo"):
        a, b = tc.forward([plain], loss).result(), tc.forward([spanned], loss).result()
        assert a.metrics["loss:sum"] == b.metrics["loss:sum"] != 0
        np.testing.assert_array_equal(lp_of(a)[0], lp_of(b)[0])
    ce = types.Datum(model_input=spanned.model_input, loss_fn_inputs={"target_tokens": prompt[1:] + tokens})
    ce = dataclasses.replace(
        ce, model_input_spans=spanned.model_input_spans, loss_fn_input_spans=spanned.loss_fn_input_spans
    )
    assert tc.forward([ce], "cross_entropy").result().metrics["loss:sum"] > 0


# ------------------------------------------------------------------------------------ refused requests


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda tc: tc.forward_backward(PROBE, "cispo"), "loss_fn: 'cispo' is not supported"),
        (
            lambda tc: tc.forward_backward(PROBE, "stable_reinforce"),
            "loss_fn: 'stable_reinforce' is not supported by this server: .* train with importance_sampling",
        ),
        (lambda tc: tc.forward([_spanned(datum([1, 5], [6]), 1)], "cross_entropy"), _MISCOVERED),
        (lambda tc: tc.forward([datum([1, 5], [6], advantages=[1.0])], "cross_entropy"), "not read by loss"),
        (
            lambda tc: tc.forward([datum([1, 5], [6])], "importance_sampling"),
            "needs \\['advantages', 'logprobs'\\]",
        ),
        (
            lambda tc: tc.forward(
                [
                    types.Datum(
                        model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [2, 9, 4]},
                    )
                ],
                "cross_entropy",
            ),
            "next-token targets",
        ),
        (lambda tc: tc.forward([datum([1, 5], [40])], "cross_entropy"), "token ids must lie in"),
        (lambda tc: tc.forward([datum([1] * 20, [2] * 20)], "cross_entropy"), "at most 31 per datum"),
        (lambda tc: tc.save_state("..", overwrite=True), "a checkpoint name is"),
        (lambda tc: tc.save_weights_for_sampler("."), "a name is"),
    ],
    ids=[
        "loss",
        "stable-reinforce",
        "spans-miscover",
        "extra-input",
        "missing-input",
        "targets",
        "vocab",
        "too-long",
        "dots",
        "dot",
    ],
)
def test_unsupported_requests_fail_with_the_sdk_error(
    served: Served, client: Any, call: Any, match: str
) -> None:
    tc = _shared_client(served, client)
    t0 = time.monotonic()
    with pytest.raises(tinker.RequestFailedError, match=match) as err:
        call(tc).result(timeout=120)
    assert err.value.category == types.RequestErrorCategory.User
    assert time.monotonic() - t0 < 60  # an answer, never a hang
    # the client still works after a refused request
    assert probe(tc)[0].shape == (5,)


_CLIENTS: dict[str, Any] = {}


def _shared_client(served: Served, client: Any) -> Any:
    if "c" not in _CLIENTS:
        _CLIENTS["c"] = client.create_lora_training_client(
            base_model=served.service.cfg.base_model, rank=8
        ).result()
    return _CLIENTS["c"]


def test_refused_creation(served: Served, client: Any) -> None:
    with pytest.raises(tinker.RequestFailedError, match="base_model"):
        client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).result()
    with pytest.raises(tinker.RequestFailedError, match="rank"):
        client.create_lora_training_client(base_model=served.service.cfg.base_model, rank=64).result()
    # the spec's limit (spec.service.maxTrainingClients), here lowered to the clients already held
    eng = served.service.engine
    limit, eng.max_models = eng.max_models, len(eng.models)
    try:
        with pytest.raises(tinker.RequestFailedError, match=r"at most \d+ training clients") as err:
            client.create_lora_training_client(base_model=served.service.cfg.base_model, rank=8).result()
        assert err.value.category == types.RequestErrorCategory.User
    finally:
        eng.max_models = limit


def test_progress_report(served: Served, client: Any) -> None:
    import json

    tc = _shared_client(served, client)
    tc.forward_backward([datum([1, 5], [6], weights=[1.0])], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    report = json.loads(Path(served.rc.progress.file).read_text())
    steps = sum(m.step for m in served.service.engine.models.values())
    assert report["step"] == steps >= 1 and report["lastCheckpointStep"] is not None


# ------------------------------------------------------------------- the rest of the SDK's surface


def test_sampling_from_another_client_and_the_base_model(served: Served, client: Any) -> None:
    """Sampler weights saved by one ServiceClient sample from another; a base-model sampling client has no
    adapter (its prompt log-probs are a fresh adapter's, whose B is zero); seeds repeat, stop token ids
    end a sequence, include_prompt_logprobs equals compute_logprobs; the async variants answer the same."""
    import asyncio

    base = served.service.cfg.base_model
    tc = client.create_lora_training_client(base_model=base, rank=4, seed=41).result()
    fresh = probe(tc)[0]  # B = 0: the base model's log-probs
    tc.forward_backward([datum([1, 5, 17], [6, 9], weights=[1.0, 1.0])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    path = tc.save_weights_for_sampler("other-client").result().path
    prompt = types.ModelInput.from_ints([1, 5, 17, 6, 9])
    with tinker.ServiceClient(base_url=served.url, api_key=API_KEY) as other:
        sc = other.create_sampling_client(model_path=path).result()
        np.testing.assert_allclose(sc.compute_logprobs(prompt).result()[1:], probe(tc)[0][:4], rtol=1e-5)
        bsc = other.create_sampling_client(base_model=base).result()
        # a handle (for another process) names the same sampler
        by_handle = tinker.SamplingClient.from_sampler_handle(sc.get_sampler_handle(), api_key=API_KEY)
        np.testing.assert_allclose(
            by_handle.compute_logprobs(prompt).result()[1:], probe(tc)[0][:4], rtol=1e-5
        )
        assert bsc.get_base_model() == base
        np.testing.assert_allclose(bsc.compute_logprobs(prompt).result()[1:], fresh[:4], rtol=1e-5, atol=1e-6)
        seeded = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
        runs = [sc.sample(prompt, 2, seeded).result() for _ in range(2)]
        assert [s.tokens for s in runs[0].sequences] == [s.tokens for s in runs[1].sequences]
        greedy = bsc.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result()
        toks = greedy.sequences[0].tokens
        assert len(toks) == 6 and greedy.sequences[0].stop_reason == "length"
        stop = toks[2]
        cut = bsc.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[stop])).result()
        first = toks.index(stop)
        assert cut.sequences[0].tokens == toks[: first + 1] and cut.sequences[0].stop_reason == "stop"
        with_plp = sc.sample(
            prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True
        ).result()
        assert with_plp.prompt_logprobs is not None and with_plp.prompt_logprobs[0] is None
        np.testing.assert_allclose(with_plp.prompt_logprobs[1:], probe(tc)[0][:4], rtol=1e-5)

        async def run_async() -> tuple[Any, ...]:
            fwd = await (await tc.forward_async(PROBE, "cross_entropy"))
            fb = await (await tc.forward_backward_async(PROBE, "cross_entropy"))
            opt = await (await tc.optim_step_async(types.AdamParams(learning_rate=0.0)))
            smp = await sc.sample_async(prompt, 2, seeded)
            lps = await sc.compute_logprobs_async(prompt)
            tc2 = await other.create_lora_training_client_async(base_model=base, rank=2)
            sc2 = await other.create_sampling_client_async(model_path=path)
            assert (await tc2.get_info_async()).lora_rank == 2
            assert (await sc2.compute_logprobs_async(prompt))[1:] == lps[1:]
            return fwd, fb, opt, smp, lps

        with pytest.warns(FutureWarning):  # the SDK deprecates *_async in favour of awaiting the futures
            fwd, fb, opt, smp, lps = asyncio.run(run_async())
        assert fb.metrics["loss:sum"] == pytest.approx(fwd.metrics["loss:sum"], rel=1e-6)
        assert opt.metrics["optim/update_skipped"] == 0
        assert [s.tokens for s in smp.sequences] == [s.tokens for s in runs[0].sequences]
        np.testing.assert_allclose(lps[1:], probe(tc)[0][:4], rtol=1e-5)


def test_rest_client_training_runs_and_checkpoints(served: Served, client: Any) -> None:
    """RestClient: the live training runs, a run's checkpoints (save_state and sampler weights), their
    info, and deleting one; an unknown run or checkpoint is the SDK's NotFoundError, with a message."""
    base = served.service.cfg.base_model
    tc = client.create_lora_training_client(base_model=base, rank=4, seed=51, train_mlp=False).result()
    state = tc.save_state("rest-1").result().path
    sampler = tc.save_weights_for_sampler("rest-s").result().path
    rest = tinker.RestClient(base_url=served.url, api_key=API_KEY)
    runs = rest.list_training_runs(limit=100).result()
    assert runs.cursor.total_count == len(served.service.engine.models)
    (run,) = [r for r in runs.training_runs if r.training_run_id == tc.model_id]
    assert (run.base_model, run.is_lora, run.lora_rank) == (base, True, 4)
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
    assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == sampler
    assert rest.get_training_run_by_tinker_path(state).result().training_run_id == tc.model_id
    ckpts = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type, c.tinker_path) for c in ckpts] == [
        ("weights/rest-1", "training", state),
        ("sampler_weights/rest-s", "sampler", sampler),
    ]
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert (info.base_model, info.lora_rank, info.train_mlp, info.train_attn) == (base, 4, False, True)
    rest.delete_checkpoint_from_tinker_path(sampler).result()
    assert [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [
        "weights/rest-1"
    ]
    with pytest.raises(tinker.UnprocessableEntityError, match="no sampler weights"):
        client.create_sampling_client(model_path=sampler).result()
    with pytest.raises(tinker.NotFoundError, match="has no checkpoint sampler_weights/rest-s"):
        rest.delete_checkpoint_from_tinker_path(sampler).result()
    with pytest.raises(tinker.NotFoundError, match="no live training client nope"):
        rest.get_training_run("nope").result()


@pytest.mark.parametrize(
    "call",
    [
        lambda r, tc, path: r.publish_checkpoint_from_tinker_path(path),
        lambda r, tc, path: r.unpublish_checkpoint_from_tinker_path(path),
        lambda r, tc, path: r.set_checkpoint_ttl_from_tinker_path(path, 3600),
        lambda r, tc, path: r.list_user_checkpoints(),
        lambda r, tc, path: r.list_sessions(),
        lambda r, tc, path: r.get_session("s-1"),
        lambda r, tc, path: tc.save_weights_external("ext"),
        lambda r, tc, path: r.copy_weights(path, destination_project_id="p-1"),
    ],
    ids=["publish", "unpublish", "ttl", "user-checkpoints", "sessions", "session", "external", "copy"],
)
def test_unsupported_sdk_calls_are_refused_at_once(served: Served, client: Any, call: Any) -> None:
    tc = _shared_client(served, client)
    path = tc.save_state("refused", overwrite=True).result().path
    rest = tinker.RestClient(base_url=served.url, api_key=API_KEY)
    t0 = time.monotonic()
    with pytest.raises(tinker.APIStatusError, match="not supported by this Tinker service") as err:
        call(rest, tc, path).result(timeout=60)
    assert err.value.status_code == 404 and time.monotonic() - t0 < 30


def test_a_refused_training_call_does_not_hold_up_the_next_request(served: Served, client: Any) -> None:
    """save_weights_external takes a seq_id of its training client; refused, it must still pass its turn,
    or the client's next request waits core.GAP_S (60 s) for it."""
    from rljob.trainer.tinker.server.core import GAP_S

    tc = _shared_client(served, client)
    tc.save_state("before-refused", overwrite=True).result()
    with pytest.raises(tinker.APIStatusError, match="not supported"):
        tc.save_weights_external("ext").result(timeout=60)
    t0 = time.monotonic()
    tc.save_state("after-refused", overwrite=True).result(timeout=2 * GAP_S)
    assert time.monotonic() - t0 < GAP_S / 4


def test_a_failure_inside_the_service_answers_at_once(
    served: Served, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception in a route is an answer naming it (HTTP 400, or a failed future of category
    server), not a 5xx: the SDK retries those for minutes."""
    from rljob.trainer.tinker import wire

    svc = served.service

    def broken(*_a: Any, **_k: Any) -> Any:
        raise OSError("storage unreachable")

    monkeypatch.setattr(svc.state, "index", broken)  # the checkpoint index on storage
    rest = tinker.RestClient(base_url=served.url, api_key=API_KEY)
    t0 = time.monotonic()
    with pytest.raises(tinker.BadRequestError, match="failed in the service: OSError: storage unreachable"):
        rest.list_checkpoints("any").result(timeout=60)
    monkeypatch.setattr(wire, "parse_forward_backward", broken)
    tc = _shared_client(served, client)
    with pytest.raises(tinker.RequestFailedError, match="OSError: storage unreachable") as err:
        tc.forward(PROBE, "cross_entropy").result(timeout=60)
    assert err.value.category == types.RequestErrorCategory.Server
    assert time.monotonic() - t0 < 30


def test_the_wire_calls_of_forward_backward_custom(served: Served, client: Any) -> None:
    """forward_backward_custom (client-side loss; the SDK needs torch for it, absent here) sends a forward
    with cross_entropy and weights 0 where the datum has none, then a forward_backward with cross_entropy
    and weights -dC/dlogprobs, signed and fractional. Both, as the SDK sends them: the forward's log-probs
    do not depend on the weights, and the backward is linear in them (C = sum(lp^2) / 2 here)."""
    base = served.service.cfg.base_model
    tc = client.create_lora_training_client(base_model=base, rank=4, seed=61).result()
    m = served.service.engine.models[tc.model_id]
    seqs = [[1, 5, 17, 6, 9], [1, 4, 20, 3, 5, 7]]

    def data(weights: list[list[float]]) -> list[Any]:
        return [
            types.Datum(
                model_input=types.ModelInput.from_ints(s[:-1]),
                loss_fn_inputs={"target_tokens": s[1:], "weights": w},
            )
            for s, w in zip(seqs, weights, strict=True)
        ]

    zeros = [[0.0] * (len(s) - 1) for s in seqs]
    lps = lp_of(tc.forward(data(zeros), "cross_entropy").result())
    ones = lp_of(tc.forward(data([[1.0] * (len(s) - 1) for s in seqs]), "cross_entropy").result())
    for a, b in zip(lps, ones, strict=True):
        np.testing.assert_array_equal(a, b)
    custom = [(-lp).tolist() for lp in lps]  # -dC/dlp for C = sum(lp^2) / 2
    fb = tc.forward_backward(data(custom), "cross_entropy").result()
    assert fb.metrics["loss:sum"] == pytest.approx(sum(float((lp * lp).sum()) for lp in lps), rel=1e-5)
    both = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(m.grads))]
    tc.optim_step(types.AdamParams(learning_rate=0.0)).result()  # clears the buffer
    halves = [[0.5 * w for w in ws] for ws in custom]
    for _ in range(2):  # gradients add up until optim_step: twice the half weights is the whole
        tc.forward_backward(data(halves), "cross_entropy").result()
    twice = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(m.grads))]
    assert sum(float(np.abs(g).sum()) for g in both) > 0
    for a, b in zip(both, twice, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    tc.optim_step(types.AdamParams(learning_rate=0.0)).result()
