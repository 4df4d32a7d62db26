"""The `rljob` command line: render/validate/plan/recipes, exit codes, one line per problem."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from rljob.cli.main import main
from rljob.recipes import recipe_catalog

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
DEMO = REPO / "examples" / "qwen3-8b-v5p.yaml"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_render_validate_plan(capsys: pytest.CaptureFixture[str], path: Path) -> None:
    code, out, err = run(capsys, "render", "-f", str(path))
    assert (code, err) == (0, "")
    docs = list(yaml.safe_load_all(out))
    spec = yaml.safe_load(path.read_text())["spec"]
    served = "service" in spec  # spec.service
    preflight = (spec.get("trainer") or {}).get("preflight", {}).get("compile", False)
    assert [d["kind"] for d in docs] == [
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ConfigMap",
        *(["Service"] if served else []),
        "NetworkPolicy",
        *(["NetworkPolicy"] if served else []),
        *(["Job"] if preflight else []),  # spec.trainer.preflight.compile
        "JobSet",
    ]
    code, out, err = run(capsys, "validate", "-f", str(path))
    assert code == 0 and out.startswith(f"{path}: valid: JobSet ")
    code, out, err = run(capsys, "plan", "-f", str(path))
    assert code == 0 and "mesh ici:" in out and "MaxText 0.2.5 keys" in out


def test_plan_explains_sources(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "-f", str(DEMO))
    assert code == 0
    lines = out.splitlines()
    assert "  tpu: v5p-8 = tpu-v5p-slice 2x2x1, machine ct5p-hightpu-4t" in lines
    assert (
        "  per slice: 4 chips, 1 hosts, 4 JAX devices (1 per chip), 1 container(s) x 4 chips per host"
        in lines
    )
    assert "  mesh ici: fsdp 4" in lines
    assert "  replicas: 1, tensor x expert x data parallel 4 x 1 x 1, max model len 5120" in lines
    vllm = (
        "  vLLM TPU backend (tpu-inference): v5p is experimental there (recommended: tpu7x, v5litepod, v6e)"
    )
    assert vllm in lines
    keys = {
        ln.split()[0]: ln.split()[-1] for ln in lines if ln.startswith("  ") and ln.rstrip().endswith("]")
    }
    assert keys["remat_policy"] == "[manifest]"
    assert keys["attention"] == "[recipe]"
    assert keys["ici_fsdp_parallelism"] == "[rljob]"


def test_plan_shows_each_roles_bytes_per_device_and_validate_refuses_what_cannot_fit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = run(capsys, "plan", "-f", str(DEMO))
    assert code == 0
    fit = [ln for ln in out.splitlines() if " fit: " in ln]
    assert fit[0].startswith("trainer fit: 5.6 GiB of 85.5 GiB per device (weights 3.8 GiB, ")
    assert (
        fit[1].startswith("sampler fit: ")
        and "the KV cache holds 463 sequences of maxModelLen 5120" in fit[1]
    )
    path = tmp_path / "big.yaml"
    path.write_text(
        "apiVersion: rljob.dev/v1alpha1\nkind: RLJob\nmetadata: {name: big}\nspec: {model: {name: "
        "Qwen/Qwen3.5-397B-A17B}, trainer: {tpu: v5p-8}, sampler: {tpu: v5p-8, tensorParallel: 2, "
        "expertParallel: 2}, storage: {root: gs://bkt}}\n",
        encoding="utf-8",
    )
    code, out, err = run(capsys, "validate", "-f", str(path))
    assert code == 2 and out == ""
    assert [ln.split(":")[0] for ln in err.splitlines()] == ["spec.trainer.tpu", "spec.sampler.tpu"]


def test_plan_shows_the_compile_preflight(capsys: pytest.CaptureFixture[str]) -> None:
    """spec.trainer.preflight: off in the demo; on in the Qwen3.5 example, with its Job and resources."""
    from rljob.recipes import naming, plan, render

    code, out, _ = run(capsys, "plan", "-f", str(DEMO))
    assert code == 0 and "  compile preflight: off (spec.trainer.preflight.compile)" in out.splitlines()
    path = REPO / "examples" / "qwen3.5-397b-tpu7x-256chips.yaml"
    job = naming.preflight_job(
        "q397b-ep1", render.preflight_digest(plan.resolve(plan.parse_manifest(path.read_text())))
    )
    code, out, _ = run(capsys, "plan", "-f", str(path))
    want = (
        f"  compile preflight: Job {job} (trainer image, CPU only: 4 CPU, 16Gi memory) compiles the "
        "trainer's programs for tpu7x-512 x 1 before the JobSet is created; a program that does not fit "
        "refuses the run"
    )
    assert code == 0 and want in out.splitlines()


def test_plan_of_a_tpu7x_sampler_says_vllm_recommends_it(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "-f", str(REPO / "examples" / "qwen3.5-397b-tpu7x-256chips.yaml"))
    assert code == 0
    assert "  vLLM TPU backend (tpu-inference): tpu7x is recommended" in out.splitlines()


def test_plan_json_is_a_runconfig(capsys: pytest.CaptureFixture[str]) -> None:
    from rljob.recipes.runconfig import RunConfig

    code, out, _ = run(capsys, "plan", "-f", str(DEMO), "-o", "json")
    assert code == 0
    assert RunConfig.model_validate(json.loads(out)).trainer.devices == 4


def test_recipes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "recipes", "list")
    assert code == 0 and [ln.split(":")[0] for ln in out.splitlines()] == recipe_catalog.names()
    code, out, _ = run(capsys, "recipes", "show", "qwen3-8b-v5p")
    assert code == 0 and yaml.safe_load(out)["name"] == "qwen3-8b-v5p"
    code, out, err = run(capsys, "recipes", "show", "nope")
    assert code == 2 and out == "" and err.startswith("nope: unknown recipe; known: gemma4-31b-v5p")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("a: [b\n", ["(yaml): line 2, column 1: did not find expected ',' or ']'"]),
        ("", ["(yaml): expected one RLJob document, found 0"]),
        ("- 1\n", ["(root): expected a mapping (an RLJob), got list"]),
        ("kind: RLJob\n", ["metadata: Field required", "spec: Field required"]),
        (
            "apiVersion: rljob.dev/v1alpha1\nkind: RLJob\nmetadata: {name: x}\n"
            "spec: {model: {name: Qwen/Qwen3-8B}, trainer: {tpu: v5p-8, mesh: {fsdp: 3}}, sampler: {tpu: "
            "v5p-9},"
            " storage: {root: gs://bkt}, lora: {rank: 7}}\n",
            [
                "spec.sampler.tpu: 'v5p-9': N counts TensorCores (2 per v5p chip) and must be a multiple "
                "of 2",
                "spec.lora.rank: 7 is not a vLLM LoRA rank (1, 8, 16, 32, 64, 128, 256, 320, 512)",
                "spec.trainer.mesh: the axes multiply to 3 (fsdp 3) but must equal the 4 devices of one "
                "slice",
            ],
        ),
    ],
)
@pytest.mark.parametrize("command", ["render", "validate", "plan"])
def test_bad_input_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str, content: str, expected: list[str]
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(content, encoding="utf-8")
    code, out, err = run(capsys, command, "-f", str(path))
    assert (code, out, err.splitlines()) == (2, "", expected)


def test_missing_file_and_usage(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "render", "-f", str(tmp_path / "nope.yaml"))
    assert (code, err) == (2, f"{tmp_path / 'nope.yaml'}: no such file\n")
    code, _, err = run(capsys, "render", "-f", str(tmp_path))
    assert (code, err) == (2, f"{tmp_path}: is a directory\n")
    with pytest.raises(SystemExit) as exit_:
        main(["render"])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit) as exit_:
        main(["frobnicate"])
    assert exit_.value.code == 2


def test_console_script_cold(tmp_path: Path) -> None:
    """The installed `rljob` from another directory: stdin input, exit codes, no traceback."""
    exe = Path(sys.executable).parent / "rljob"
    ok = subprocess.run(
        [str(exe), "render", "-f", "-"], input=DEMO.read_text(), capture_output=True, text=True, cwd=tmp_path
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == (REPO / "tests" / "recipes" / "golden" / "example-qwen3-8b-v5p.yaml").read_text()
    bad = subprocess.run(
        [str(exe), "plan", "-f", "-"], input="kind: [", capture_output=True, text=True, cwd=REPO
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stdout == ""


def test_plan_names_the_service(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "-f", str(EXAMPLES[0].parent / "qwen3-8b-tinker-service.yaml"))
    assert code == 0
    assert (
        "service: tinker API at http://qwen3-8b-tinker-api.default.svc:8080, up to 4 training clients, "
        "checkpoint every 1 steps (no built-in RL loop)"
    ) in out.splitlines()


def test_rljob_plan_shows_the_schedule_and_the_trainer_keys() -> None:
    from fixtures.recipes import manifest, resolve
    from rljob.cli.main import explain

    keys = {"adam_b1": 0.5, "checkpoint_period": 7}
    text = explain(resolve(manifest({"trainer": {"maxtext": keys}, "algorithm": {"warmupSteps": 10}})))
    assert ", lr 1e-05, warm-up 10 steps\n" in text
    assert "  adam_b1 " in text and "  checkpoint_period " in text and "[manifest]" in text
    assert "learning_rate" not in text and "run_name" not in text
    cosine = explain(resolve(manifest({"algorithm": {"learningRateSchedule": "cosine"}})))
    assert ", lr 1e-05, cosine decay\n" in cosine
