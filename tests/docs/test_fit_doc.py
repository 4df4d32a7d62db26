"""docs/fit.md's refusal example is what `rljob validate` prints for the manifest it names (it had kept two
lines of a KV-head rule since relaxed), and its "The catalog's figures" is the plan's fit
(rljob.recipes.fit.of_run, what `rljob plan` shows) of every case `rljob drill --all` runs: each catalog
recipe, each of its profiles and each example, row for row in that order (it had lost three cases; `rows()`
writes it).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from rljob.cli.drill.cases import all_cases, resolve_doc
from rljob.recipes import fit

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "fit.md"
HEADER = "| manifest | trainer | trainer GiB | weights | layer inputs | sampler replica | sampler GiB | KV |"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def rows() -> list[str]:
    out = []
    for case in all_cases():
        rc = resolve_doc(case.doc)
        f = fit.of_run(rc)
        t, s, sampler = f.trainer, f.sampler, rc.sampler
        assert t is not None and s is not None and sampler is not None
        name = case.name.replace("/", " / ")
        if case.name.startswith("example/"):
            name = f"examples/{case.name.removeprefix('example/')}.yaml"
            quantization = rc.spec.sampler.weights.quantization
            name += f" ({quantization.upper()} sampler)" if quantization != "bfloat16" else ""
        out.append(
            f"| {name} | {rc.trainer.tpu.type_name} x {rc.trainer.slices} | {_gib(t.used_bytes)} / "
            f"{_gib(t.capacity_bytes)} | {_gib(t.parts['weights'])} | {_gib(t.parts['layer_inputs'])} | "
            f"{sampler.tpu.type_name} tp {sampler.tensor_parallel} x ep {sampler.expert_parallel} | "
            f"{_gib(s.parts['weights'])} / {_gib(s.capacity_bytes)} | {s.kv_sequences} x "
            f"{sampler.max_model_len} ({sampler.max_num_seqs}) |"
        )
    return out


def table(text: str) -> list[str]:
    out = []
    for line in text.split(HEADER + "\n", 1)[1].splitlines()[1:]:
        if not line.startswith("|"):
            break
        out.append(line)
    return out


def test_the_catalog_table_is_the_plans() -> None:
    assert table(DOC.read_text()) == rows()


# The manifest docs/fit.md's example names: Qwen/Qwen3.5-397B-A17B, trainer and sampler tpu v5p-8.
BIG = {
    "apiVersion": "rljob.dev/v1alpha1",
    "kind": "RLJob",
    "metadata": {"name": "big"},
    "spec": {
        "model": {"name": "Qwen/Qwen3.5-397B-A17B", "maxtextModel": "qwen3.5-397b-a17b"},
        "trainer": {"tpu": "v5p-8"},
        "sampler": {"tpu": "v5p-8"},
        "storage": {"root": "gs://bucket"},
    },
}


def test_the_refusal_example_is_what_validate_prints(tmp_path: Path) -> None:
    text = DOC.read_text()
    block = text.split("$ rljob validate -f big.yaml", 1)[1].split("```", 1)[0].splitlines()[1:]
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(BIG))
    rljob = Path(sys.executable).parent / "rljob"
    r = subprocess.run([str(rljob), "validate", "-f", str(path)], capture_output=True, text=True, check=False)
    assert r.returncode == 2
    assert block == r.stderr.splitlines() + r.stdout.splitlines()
