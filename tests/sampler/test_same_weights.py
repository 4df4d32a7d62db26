"""Trainer and sampler start from the same weights, in every catalog recipe, profile and example: the
rendered run config (the ConfigMap's run.json both roles read) gives the trainer a MaxText checkpoint
converted from exactly the Hugging Face model and revision the sampler's `vllm serve` command loads, or,
where spec.sampler.weights declares a quantized checkpoint of that model, the sampler loads that checkpoint
with its quantization method and the parity gate's tolerance is the quantization's
(rljob.recipes.quantization)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fixtures.recipes import catalog_cases, objects
from rljob.recipes import quantization
from rljob.recipes.runconfig import CONFIG_KEY, RunConfig
from rljob.sampler.vllm import build_command
from rljob.trainer.hf_weights import BaseWeights, WeightsError, base_weights, check_source

CASES = catalog_cases()


def _rendered(doc: dict[str, Any]) -> RunConfig:
    cms = [o for o in objects(doc) if o["kind"] == "ConfigMap" and CONFIG_KEY in o.get("data", {})]
    assert len(cms) == 1
    return RunConfig.model_validate(json.loads(cms[0]["data"][CONFIG_KEY]))


def _served(rc: RunConfig) -> tuple[str, str]:
    argv = build_command(rc).argv
    assert argv[:2] == ["vllm", "serve"]
    return argv[2], argv[argv.index("--revision") + 1]


@pytest.mark.parametrize(("name", "doc"), CASES, ids=[c[0] for c in CASES])
def test_both_roles_name_the_same_weights(name: str, doc: dict[str, Any]) -> None:
    rc = _rendered(doc)
    bw = base_weights(rc)
    weights = rc.spec.sampler.weights
    q = quantization.get(weights.quantization)
    assert (bw.model, bw.revision) == (rc.spec.model.name, rc.spec.model.revision)
    assert weights.parity_tolerance == q.parity_tolerance
    argv = build_command(rc).argv
    if q.vllm_method is None:
        assert _served(rc) == (bw.model, bw.revision)
        assert "--quantization" not in argv
    else:  # a declared quantization of the trainer's model, loaded as one
        assert _served(rc) == (weights.name, weights.revision) != (bw.model, bw.revision)
        assert argv[argv.index("--quantization") + 1] == q.vllm_method
        assert weights.parity_tolerance > quantization.BF16_PARITY_NATS
    # No catalog entry names a checkpoint: the trainer converts the served model itself, into a directory
    # keyed by that model, revision and the trainer's MaxText version.
    assert bw.convert and bw.directory is not None
    assert bw.directory.endswith(
        f"/cache/converted/{bw.model}@{bw.revision}/maxtext-{rc.spec.trainer.maxtext_version}"
    )
    assert bw.checkpoint == f"{bw.directory}/0/items"


def test_a_revision_reaches_both_roles() -> None:
    _, doc = CASES[0]
    doc = json.loads(json.dumps(doc))
    doc["spec"].setdefault("model", {})["revision"] = "0123abcd"
    rc = _rendered(doc)
    assert _served(rc)[1] == base_weights(rc).revision == "0123abcd"
    assert "@0123abcd/" in str(base_weights(rc).directory)


@pytest.mark.parametrize(
    ("marker", "refused"),
    [
        (None, False),  # the user's own conversion: the step-0 parity gate checks it
        ({"model": "Qwen/Qwen3-8B", "revision": "main", "maxtext": "0.2.5"}, False),
        ({"model": "Qwen/Qwen3-4B", "revision": "main", "maxtext": "0.2.5"}, True),
        ({"model": "Qwen/Qwen3-8B", "revision": "abc123", "maxtext": "0.2.5"}, True),
    ],
)
def test_a_checkpoint_rljob_converted_from_another_model_is_refused(
    tmp_path: Any, marker: dict[str, str] | None, refused: bool
) -> None:
    directory = tmp_path / "Qwen3-x@main" / "maxtext-0.2.5"
    (directory / "0" / "items").mkdir(parents=True)
    if marker is not None:
        (directory / "rljob-converted.json").write_text(json.dumps(marker))
    bw = BaseWeights("Qwen/Qwen3-8B", "main", "0.2.5", f"{directory}/0/items", None)
    if refused:
        with pytest.raises(WeightsError, match=r"^spec\.model\.checkpoint: .* was converted from Qwen/"):
            check_source(bw)
    else:
        check_source(bw)


# A moving spec.model.revision: the trainer's process 0 resolves it once per run and pins the commit in
# the run's storage (rljob.common.revision); the sampler serves the pinned commit, not the ref.

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


class _Hub:
    """The Hub's answer for a ref, which a test moves; counts the questions."""

    def __init__(self, commit: str | None) -> None:
        self.commit, self.asked = commit, 0

    def __call__(self, _model: str, _ref: str) -> str | None:
        self.asked += 1
        return self.commit


def _run(tmp_path: Any, revision: str = "main", checkpoint: bool = True) -> RunConfig:
    """A catalog run config with its storage under ``tmp_path``; with ``checkpoint`` the trainer's base
    weights are a user's conversion (spec.model.checkpoint), so its start converts nothing."""
    _, doc = CASES[0]
    doc = json.loads(json.dumps(doc))
    doc["spec"].setdefault("model", {})["revision"] = revision
    rc = _rendered(doc)
    model = rc.spec.model.model_copy(
        update={"checkpoint": str(tmp_path / "user" / "0" / "items")} if checkpoint else {}
    )
    return rc.model_copy(
        update={
            "storage": rc.storage.model_copy(update={"root": str(tmp_path / "run")}),
            "spec": rc.spec.model_copy(update={"model": model}),
        }
    )


def _trainer_start(rc: RunConfig, hub: _Hub, monkeypatch: pytest.MonkeyPatch) -> str:
    """The revision a trainer start (rljob.trainer.main.prepare_base_weights, process 0) trains: the one
    its base weights are checked against (a run with spec.model.checkpoint converts nothing)."""
    from rljob.trainer import hf_weights
    from rljob.trainer.main import prepare_base_weights

    checked: list[BaseWeights] = []
    with monkeypatch.context() as m:
        m.setattr(hf_weights, "hub_commit", hub)
        m.setattr(hf_weights, "check_source", checked.append)
        assert prepare_base_weights(rc, {}) == rc.spec.model.checkpoint
    assert len(checked) == 1 and checked[0].model == rc.spec.model.name
    return checked[0].revision


def _sampler_start(rc: RunConfig, timeout_s: float = 5.0) -> str:
    """The --revision of a sampler start's `vllm serve` (rljob.sampler.main)."""
    from rljob.sampler.main import served_revision

    argv = build_command(rc, pinned=served_revision(rc, timeout_s, poll_s=0.01)).argv
    return argv[argv.index("--revision") + 1]


@pytest.mark.jax
def test_both_roles_serve_and_train_the_commit_the_trainer_pinned(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rc = _run(tmp_path)
    hub = _Hub(COMMIT_A)
    assert _trainer_start(rc, hub, monkeypatch) == COMMIT_A
    assert _sampler_start(rc) == COMMIT_A
    # main moves on the Hub: a sampler started (or restarted) after it and a restarted trainer still load
    # the run's commit, and the trainer does not ask the Hub again.
    hub.commit = COMMIT_B
    assert _sampler_start(rc) == COMMIT_A
    assert _trainer_start(rc, hub, monkeypatch) == COMMIT_A
    assert hub.asked == 1
    # Another run (another uid: another storage root) resolves anew.
    other = rc.model_copy(update={"storage": rc.storage.model_copy(update={"root": str(tmp_path / "run2")})})
    assert _trainer_start(other, hub, monkeypatch) == COMMIT_B == _sampler_start(other)


@pytest.mark.jax
def test_without_a_route_to_the_hub_both_roles_load_the_ref_as_written(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rc = _run(tmp_path)
    assert _trainer_start(rc, _Hub(None), monkeypatch) == "main" == _sampler_start(rc)


def test_a_sampler_started_before_the_trainer_waits_for_its_pin(tmp_path: Any) -> None:
    import threading

    from rljob.common import revision

    rc = _run(tmp_path)
    threading.Timer(
        0.3, revision.write, (rc.storage.root, revision.Pinned(rc.spec.model.name, "main", COMMIT_A))
    ).start()
    assert _sampler_start(rc, timeout_s=30.0) == COMMIT_A


def test_a_manifest_naming_a_commit_needs_no_pin(tmp_path: Any) -> None:
    rc = _run(tmp_path, revision=COMMIT_B)
    assert _sampler_start(rc, timeout_s=0.0) == COMMIT_B
    assert not (tmp_path / "run").exists()  # nothing read or written


def test_a_pin_that_never_appears_exits_for_a_counted_restart_not_a_hang(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import subprocess
    import time

    from rljob.recipes.failure import EXIT_BAD_CONFIG, EXIT_RESTART
    from rljob.sampler import main as sampler_main

    rc = _run(tmp_path)
    monkeypatch.setattr(sampler_main, "preflight", lambda: None)
    started: list[Any] = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))  # what run_vllm starts
    t0 = time.monotonic()
    code = sampler_main.run_vllm(rc, None, 0, 0, revision_wait_s=0.5)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 10
    assert code == EXIT_RESTART and EXIT_RESTART not in (0, EXIT_BAD_CONFIG) and not started
    err = capsys.readouterr().err
    assert err.startswith(
        f"spec.model.revision: {rc.spec.model.name}@main: the trainer wrote no pinned commit"
    )


@pytest.mark.jax
def test_the_trainers_chat_tokenizer_is_the_pinned_commits(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer renders chat prompts with the tokenizer at the commit both roles load (vLLM takes its
    tokenizer at the model's revision), not at whatever the ref names when the trainer (re)starts: the loop
    resolves the pin first (rljob.trainer.main.resolved_base_weights), then loads the tokenizer at it."""
    import transformers
    from rljob.trainer import hf_weights
    from rljob.trainer.loop import chat_tokenizer
    from rljob.trainer.main import resolved_base_weights

    loaded: list[tuple[str, str | None]] = []
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        lambda name, revision=None, **_: loaded.append((name, revision)),
    )
    rc = _run(tmp_path)
    hub = _Hub(COMMIT_A)
    for moved_to in (COMMIT_A, COMMIT_B):  # the first start, then a restart after main moved
        hub.commit = moved_to
        with monkeypatch.context() as m:
            m.setattr(hf_weights, "hub_commit", hub)
            bw = resolved_base_weights(rc)
        load = chat_tokenizer(rc, "config", bw.revision)
        assert load is not None
        load()
    assert loaded == [(rc.spec.model.name, COMMIT_A)] * 2 and hub.asked == 1
    # Without a pinned commit (none given), the ref as written, never the Hub's default branch.
    tagged = _run(tmp_path / "t", revision="v1.0")
    load = chat_tokenizer(tagged, "config")
    assert load is not None
    load()
    assert loaded[-1] == (rc.spec.model.name, "v1.0")
    assert chat_tokenizer(rc, "tiny") is None
