"""`rljob submit | list | status | logs | delete`: the formatting and the failures without a cluster here; the
commands against the local cluster with the operator in tests/cli/test_job_commands_cluster.py."""

from __future__ import annotations

import copy
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rljob.cli import jobs

TESTED_MODULES = ("rljob.cli.jobs",)

REPO = Path(__file__).resolve().parents[2]
RLJOB = Path(sys.executable).parent / "rljob"

# A kubeconfig whose API server refuses connections: a command that reaches for the cluster says so.
UNREACHABLE = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: x}}]
contexts: [{name: ctx, context: {cluster: c, user: u, namespace: team}}]
current-context: ctx
"""


@pytest.mark.parametrize(
    ("values", "line"),
    [
        ([], ""),
        ([0.5, 0.5, 0.5], "▅▅▅"),
        ([0.0, 1.0], "▁█"),
        ([0.0, 0.5, 1.0], "▁▅█"),
        ([1.0, 0.0], "█▁"),
    ],
)
def test_sparkline(values: list[float], line: str) -> None:
    assert jobs.sparkline(values) == line


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=500), st.integers(1, 80))
def test_sparkline_width_and_extremes(values: list[float], width: int) -> None:
    line = jobs.sparkline(values, width)
    assert len(line) == min(len(values), width)
    assert set(line) <= set(jobs.SPARK)
    if len(values) <= width and min(values) != max(values):
        assert line[values.index(min(values))] == "▁" and line[values.index(max(values))] == "█"


@pytest.mark.parametrize(
    ("seconds", "text"), [(5, "5s"), (59, "59s"), (60, "1m"), (119, "1m"), (7200, "2h"), (3 * 86400, "3d")]
)
def test_age(seconds: int, text: str) -> None:
    now = datetime(2026, 1, 2, tzinfo=UTC)
    then = datetime.fromtimestamp(now.timestamp() - seconds, UTC).isoformat().replace("+00:00", "Z")
    assert jobs.age(then, now) == text


OBJ = {
    "metadata": {"name": "grpo", "namespace": "rl", "creationTimestamp": "2026-01-01T00:00:00Z"},
    "spec": {"algorithm": {"steps": 50}},
    "status": {
        "phase": "Running",
        "jobSetName": "grpo",
        "restarts": {"used": 1, "left": 2},
        "progress": {"step": 12, "rewardMean": 0.4375, "lastCheckpointStep": 10},
        "roles": {"trainer": {"ready": 1, "total": 1}, "sampler": {"ready": 2, "total": 2}},
        "lastFailure": {
            "class": "crash",
            "reason": "Exit1",
            "message": "boom",
            "time": "2026-01-01T00:05:00Z",
        },
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "PodsReady", "message": "all pods ready"}
        ],
    },
}


def test_table_and_wide() -> None:
    lines = jobs.table([OBJ]).splitlines()
    assert lines[0].split() == ["NAME", "PHASE", "STEP", "REWARD", "RESTARTS", "AGE"]
    assert lines[1].split()[:5] == ["grpo", "Running", "12", "0.438", "1"]
    wide = jobs.table([OBJ], wide=True, all_namespaces=True).splitlines()
    assert wide[0].split() == [
        "NAMESPACE", "NAME", "PHASE", "STEP", "REWARD", "RESTARTS", "AGE", "JOBSET", "LAST-FAILURE", "URL",
    ]  # fmt: skip
    assert wide[1].split()[:6] == ["rl", "grpo", "Running", "12", "0.438", "1"]
    assert wide[1].split()[-2:] == ["grpo", "crash"]
    # A new RLJob without status: empty columns, no crash.
    assert jobs.table([{"metadata": {"name": "new"}}]).splitlines()[1].split() == ["new", "0", "<unknown>"]


def test_describe() -> None:
    text = jobs.describe(OBJ, [(1, 0.0), (2, 0.25), (3, 1.0)])
    assert "Phase:       Running" in text
    assert "Step:        12 of 50" in text
    assert "Reward:      0.438" in text
    assert "Restarts:    1 used, 2 left" in text
    assert "Last failure: crash Exit1 at 2026-01-01T00:05:00Z: boom" in text
    assert "  Ready=True PodsReady: all pods ready" in text
    assert "Reward by step (1..3, min 0.000, max 1.000):\n  ▁▃█" in text
    assert "Reward by step: no events yet" in jobs.describe(OBJ, [], "no events yet")
    # Per-role restarts and the role that failed (JobSet >= v0.12: sampler Jobs restart alone).
    base: dict[str, Any] = copy.deepcopy(OBJ["status"])  # type: ignore[arg-type]
    status = {
        **base,
        "restarts": {"used": 1, "left": 2, "sampler": {"used": 4, "left": 6}},
        "lastFailure": {**base["lastFailure"], "role": "sampler"},
    }
    text = jobs.describe({**OBJ, "status": status}, [])
    assert "Restarts:    1 used, 2 left (the run); sampler 4 used, 6 left" in text
    assert "Last failure: crash Exit1 of the sampler at 2026-01-01T00:05:00Z: boom" in text
    # JobSet's gate RestartJob off: a sampler crash restarts the run, counted with the run's restarts.
    status = {**status, "restarts": {"used": 1, "left": 2}, "samplerFailure": "RestartRun"}
    text = jobs.describe({**OBJ, "status": status}, [])
    assert (
        "Restarts:    1 used, 2 left (the run, sampler crashes included: JobSet's gate RestartJob is off)"
        in text
    )


HOSTILE_MESSAGES = [
    # (what a container's log can put in a status message, how `rljob status` prints it)
    ("\x1b[2J\x1b[31mboom", "\\x1b[2J\\x1b[31mboom"),  # clear the screen, red
    ("\x1b]8;;http://x\x07link\x1b]8;;\x07", "\\x1b]8;;http://x\\x07link\\x1b]8;;\\x07"),  # OSC 8 link
    ("ok\rPhase:       Succeeded", "ok\\rPhase:       Succeeded"),  # overwrite the line
    ("boom\nPhase:       Succeeded", "boom Phase:       Succeeded"),  # forge a line
    (
        "a\u202eb\u2028c\x9bd\x7f",
        "a\\u202eb\\u2028c\\x9bd\\x7f",
    ),  # bidi override, line separator, C1 CSI, DEL
]


@pytest.mark.parametrize(("raw", "shown"), HOSTILE_MESSAGES)
def test_status_and_list_print_no_terminal_control(raw: str, shown: str) -> None:
    """Condition and failure messages (and every other string of the object) are printed with their control
    characters escaped and newlines as spaces: nothing from a container's log reaches the terminal raw."""
    base: dict[str, Any] = copy.deepcopy(OBJ["status"])  # type: ignore[arg-type]
    status = {
        **base,
        "lastFailure": {**base["lastFailure"], "message": raw},
        "conditions": [{"type": "Ready", "status": "False", "reason": "Crashed", "message": raw}],
    }
    obj = {**OBJ, "status": status}
    text = jobs.describe(obj, [])
    assert f"Last failure: crash Exit1 at 2026-01-01T00:05:00Z: {shown}\n" in text
    assert f"  Ready=False Crashed: {shown}\n" in text
    assert all(ch == "\n" or ch.isprintable() for ch in text)
    assert len(text.splitlines()) == len(jobs.describe(OBJ, []).splitlines())  # no forged line
    named = {**obj, "metadata": {**OBJ["metadata"], "name": raw}}  # type: ignore[dict-item]
    listed = jobs.table([named], wide=True)
    assert all(ch == "\n" or ch.isprintable() for ch in listed) and len(listed.splitlines()) == 2


def test_describe_counts_the_steps_the_plan_resolves() -> None:
    """Without spec.algorithm.steps the total is the recipe's, or the defaults table's."""
    from rljob.recipes import defaults, recipe_catalog

    bare = {**OBJ, "spec": {}}
    assert f"Step:        12 of {defaults.value('algorithm.steps')}\n" in jobs.describe(bare, [])
    recipe = recipe_catalog.load("qwen3-8b-v5p").spec.algorithm
    assert recipe is not None and recipe.steps is not None
    with_recipe = {**OBJ, "spec": {"recipe": "qwen3-8b-v5p"}}
    assert f"Step:        12 of {recipe.steps}\n" in jobs.describe(with_recipe, [])
    assert "Step:        12 of ?\n" in jobs.describe({**OBJ, "spec": {"algorithm": {"steps": "x"}}}, [])


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(RLJOB), *args], capture_output=True, text=True, input=stdin, timeout=60)


def test_submit_of_a_bad_manifest_exits_2_before_reaching_the_cluster(tmp_path: Path) -> None:
    kc = tmp_path / "kubeconfig"
    kc.write_text(UNREACHABLE)
    bad = (REPO / "examples" / "qwen3-8b-v5p.yaml").read_text().replace("tpu: v5p-8", "tpu: v5p-7")
    proc = _run("submit", "-f", "-", "--kubeconfig", str(kc), stdin=bad)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines and all(line.startswith("spec.") for line in lines), lines
    assert "cannot reach" not in proc.stderr


def test_namespace_flag_and_manifest_must_agree(tmp_path: Path) -> None:
    kc = tmp_path / "kubeconfig"
    kc.write_text(UNREACHABLE)
    proc = _run(
        "submit", "-f", str(REPO / "examples" / "qwen3-8b-v5p.yaml"), "-n", "other", "--kubeconfig", str(kc)
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "rljob: metadata.namespace: default differs from -n other"


@pytest.mark.parametrize("verb", [["list"], ["status", "x"], ["logs", "x"], ["delete", "x"]])
def test_unreachable_cluster_is_one_line_exit_1(tmp_path: Path, verb: list[str]) -> None:
    kc = tmp_path / "kubeconfig"
    kc.write_text(UNREACHABLE)
    proc = _run(*verb, "--kubeconfig", str(kc))
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert "cannot reach the cluster" in line and "team" in line  # the context's namespace
    assert "Traceback" not in proc.stderr


def test_no_kubeconfig_is_bad_input(tmp_path: Path) -> None:
    proc = _run("list", "--kubeconfig", str(tmp_path / "missing"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("rljob: no cluster configured")


def test_status_names_the_profile_of_a_profiled_run() -> None:
    """profiler: xplane in the spec's MaxText keys: `rljob status` names the trace directory on storage and
    the steps traced; a run without a profiler has no such line."""
    from rljob.cli import metrics

    spec: dict[str, Any] = {
        "model": {"name": "Qwen/Qwen3-8B"},
        "trainer": {"tpu": "v5p-8", "maxtext": {"profiler": "xplane", "profiler_steps": 3}},
        "sampler": {"tpu": "v5p-8"},
        "storage": {"root": "gs://bkt/runs"},
    }
    obj: dict[str, Any] = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "grpo", "namespace": "rl", "uid": "u1"},
        "spec": spec,
    }
    note = metrics.profile_note(obj)
    assert note == (
        "gs://bkt/runs/rl/grpo/u1/tensorboard/plugins/profile (steps 1..3; TensorBoard's profile plugin or "
        "XProf: tensorboard --logdir gs://bkt/runs/rl/grpo/u1/tensorboard)"
    )
    assert f"Profile:     {note}\n" in jobs.describe({**OBJ, **obj}, [], "", note)
    plain = {**obj, "spec": {**spec, "trainer": {"tpu": "v5p-8"}}}
    assert metrics.profile_note(plain) == "" and "Profile:" not in jobs.describe(OBJ, [])


def test_describe_shows_the_newest_evaluation() -> None:
    """status.progress.evaluation (the trainer's ProgressReport, rljob.trainer.evaluation.report)."""
    from rljob.trainer.evaluation import report

    ev = report(
        20,
        {
            "eval_reward": 0.4,
            "eval_pass_at_k": 0.625,
            "eval_pass_k": 4.0,
            "eval_maj_at_k": 0.5,
            "eval_maj_k": 8.0,
        },
    )
    assert ev is not None and report(21, {"reward_mean": 0.3}) is None  # a step without an evaluation
    base: dict[str, Any] = copy.deepcopy(OBJ["status"])  # type: ignore[arg-type]
    status = {**base, "progress": {**base["progress"], "evaluation": ev.model_dump(mode="json")}}
    text = jobs.describe({**OBJ, "status": status}, [])
    assert "Evaluation:  step 20: pass@4 0.625, maj@8 0.500, mean reward 0.400" in text
    assert "Evaluation:" not in jobs.describe(OBJ, [])
