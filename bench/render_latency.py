#!/usr/bin/env python3
"""Cold `rljob render` latency, and its ratio to `helm template` of an equally sized JobSet chart.

Prints JSON lines {"bench", "metric", "value", ...context}. Each run is a fresh process (cold
interpreter, warm page cache), as a user or CI step would run it:

    .venv/bin/python bench/render_latency.py [--runs 9]

Helm: hack/bin/helm (built by hack/build.sh from HELM_VERSION) or helm on PATH; the chart is made on
the fly from the golden render of the same example (values substituted for its name), so both tools
emit the same objects. Without helm the ratio line carries "skipped" with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "qwen3-8b-v5p.yaml"
BENCH = "render_latency"


def emit(metric: str, value: float | None, **context: Any) -> None:
    print(json.dumps({"bench": BENCH, "metric": metric, "value": value, **context}), flush=True)


def timed(cmd: list[str], runs: int, env: dict[str, str] | None = None) -> list[float]:
    out = []
    subprocess.run(cmd, capture_output=True, env=env, check=True)  # one warm-up for the page cache
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, capture_output=True, env=env, check=True)
        out.append(time.perf_counter() - t0)
    return out


def stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"median_s": round(statistics.median(s), 4), "min_s": round(s[0], 4), "max_s": round(s[-1], 4)}


def helm_binary() -> tuple[str | None, str]:
    local = REPO / "hack" / "bin" / "helm"
    if local.exists() and os.access(local, os.X_OK):
        return str(local), "hack/bin/helm"
    found = shutil.which("helm")
    if found:
        return found, "PATH"
    return None, "no helm binary: hack/bin/helm absent (hack/build.sh helm builds it) and none on PATH"


def make_chart(root: Path, name: str) -> Path:
    golden = (REPO / "tests" / "recipes" / "golden" / "example-qwen3-8b-v5p.yaml").read_text(encoding="utf-8")
    chart = root / "rljob-bench"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: rljob-bench\nversion: 0.1.0\n", encoding="utf-8")
    (chart / "values.yaml").write_text(f"name: {name}\n", encoding="utf-8")
    escaped = golden.replace("{{", '{{ "{{" }}')
    (chart / "templates" / "objects.yaml").write_text(
        escaped.replace(name, "{{ .Values.name }}"), encoding="utf-8"
    )
    return chart


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    exe = str(Path(sys.executable).parent / "rljob")
    # Bytecode as an installed package has it: the first (warm-up) run writes the .pyc files the render
    # imports. This machine sets PYTHONDONTWRITEBYTECODE=1, which would make every run recompile
    # ~1000 modules (about +0.6 s) and measure the compiler instead of rljob.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONSAFEPATH"] = "1"
    ctx = {
        "bytecode": "cached",
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "runs": args.runs,
        "example": EXAMPLE.name,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }

    base = stats(timed([sys.executable, "-c", "pass"], args.runs, env))
    emit("python_startup_s", base["median_s"], **base, **ctx)
    helpt = stats(timed([exe, "--help"], args.runs, env))
    emit("rljob_help_cold_s", helpt["median_s"], **helpt, **ctx)
    render = stats(timed([exe, "render", "-f", str(EXAMPLE)], args.runs, env))
    emit("rljob_render_cold_s", render["median_s"], **render, **ctx)

    # in-process: the render path alone once imports are warm (what the operator pays per reconcile)
    code = (
        "import time,sys;from rljob.recipes import plan,render;"
        f"t=open({str(EXAMPLE)!r}).read();render.to_yaml(render.render(plan.parse_manifest(t)));"
        "n=50;t0=time.perf_counter()\n"
        "for _ in range(n): render.to_yaml(render.render(plan.parse_manifest(t)))\n"
        "print((time.perf_counter()-t0)/n)"
    )
    warm = float(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        ).stdout
    )
    emit("render_warm_in_process_s", round(warm, 5), **ctx)

    helm, where = helm_binary()
    if helm is None:
        emit("ratio_to_helm_template", None, skipped=where, **ctx)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        chart = make_chart(Path(tmp), "qwen3-8b-demo")
        hstats = stats(timed([helm, "template", "bench", str(chart)], args.runs, env))
    version = subprocess.run([helm, "version", "--short"], capture_output=True, text=True).stdout.strip()
    emit("helm_template_cold_s", hstats["median_s"], **hstats, helm=where, helm_version=version, **ctx)
    emit(
        "ratio_to_helm_template",
        round(render["median_s"] / hstats["median_s"], 3),
        goal="<= 1.0",
        helm=where,
        helm_version=version,
        **ctx,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
