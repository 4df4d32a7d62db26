#!/usr/bin/env python3
"""The admission webhook's worst case: time and memory of the largest inputs it is given, next to a
typical manifest, against the limits that matter (the webhook's 1 s budget, far under the API server's
10 s timeoutSeconds; the chart's operator memory limit).

    .venv/bin/python bench/webhook_worst_case.py [--runs 5]

Prints JSON lines {"bench", "metric", "value", ...context}. Each case runs in a fresh process that imports
what the operator process imports (kopf, the handlers; not the `kubernetes` client, as rljob-operator
blocks it) and then, `--runs` times, does what one admission request costs the operator's event loop:
`json.loads` of the AdmissionReview as the API server sends it, and the webhook's plan of its object
(rljob.operator.plans.PlanCache.make_plan, a fresh cache each time: no hits), after the warm-up the
operator's start-up does (rljob.operator.plans.warm_up). Metrics per case: `seconds` (median and max
of the runs), `startup_warm_up_seconds` (what the first request would pay without the warm-up),
`peak_rss_mib` (the process's peak resident memory: imports, the request and its plan; what counts against
the container's limit) and `request_kib`.

The cases are the largest inputs the bounds of rljob.recipes.manifest let through (and one past them):
every string field at its maximum, 1,024 MaxText keys (the CRD's maxProperties) with 64-character names,
a MaxText value of 256 KiB of JSON, 10,000 values, 32 levels of nesting, and a 3 MiB body (the API
server's request limit) that the bounds refuse.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = "webhook_worst_case"
BUDGET_S = 1.0


def emit(metric: str, value: Any, **context: Any) -> None:
    print(json.dumps({"bench": BENCH, "metric": metric, "value": value, **context}), flush=True)


def chart_memory_limit_mib() -> float:
    import yaml

    limit = str(
        yaml.safe_load((REPO / "charts" / "rljob" / "values.yaml").read_text())["resources"]["limits"][
            "memory"
        ]
    )
    units = {"Mi": 1.0, "Gi": 1024.0, "Ki": 1 / 1024}
    for suffix, scale in units.items():
        if limit.endswith(suffix):
            return float(limit[: -len(suffix)]) * scale
    return float(limit) / 2**20


def _base() -> dict[str, Any]:
    import yaml

    body: dict[str, Any] = yaml.safe_load((REPO / "examples" / "qwen3-8b-v5p.yaml").read_text())
    body["metadata"] = {
        "name": "bench",
        "namespace": "ns",
        "uid": "6f0c5d3e-8a4b-4b55-9f1e-2b7d2c9e0a11",
        "generation": 1,
    }
    return body


def cases() -> dict[str, dict[str, Any]]:
    keys = json.loads((REPO / "recipes" / "data" / "maxtext-0.2.5-keys.json").read_text())["keys"]
    out: dict[str, dict[str, Any]] = {"typical (examples/qwen3-8b-v5p.yaml)": _base()}

    body = _base()
    body["spec"].update(
        {
            "model": {"name": "o" * 63 + "/" + "m" * 64, "maxtextModel": "qwen3-8b"},
            "dataset": {"promptTemplate": "{question}" + "t" * (16384 - 10)},
            "queueName": "q" * 63,
            "priorityClassName": ".".join(["p" * 63] * 4)[:253].rstrip("."),
        }
    )
    body["spec"]["trainer"]["image"] = "registry.example.com:5000/" + "a" * 400 + ":" + "t" * 80
    body["spec"]["sampler"] = {**body["spec"].get("sampler", {}), "image": "b" * 500}
    out["every string at its maximum"] = body

    body = _base()
    real = [k for k in keys if len(json.dumps(keys[k])) < 64][:700]
    maxtext = {k: keys[k] for k in real}
    maxtext.update({f"unknown_key_{i:05d}_" + "x" * 44: i for i in range(1024 - len(maxtext))})
    body["spec"]["trainer"]["maxtext"] = maxtext
    out["1024 MaxText keys (maxProperties), 64-character unknown names"] = body

    body = _base()
    body["spec"]["trainer"]["maxtext"] = {"remat_policy": ["r" * 1000] * 250}
    out["a MaxText value of 256 KiB"] = body

    body = _base()
    body["spec"]["trainer"]["maxtext"] = {"remat_policy": list(range(9800))}
    out["10,000 values"] = body

    body = _base()
    deep: Any = "leaf"
    for _ in range(26):
        deep = {"d": deep}
    body["spec"]["trainer"]["maxtext"] = {"remat_policy": deep}
    out["32 levels of nesting"] = body

    body = _base()
    body["spec"]["trainer"]["maxtext"] = {"remat_policy": ["z" * 1000] * 3000}
    out["a 3 MiB body (the API server's request limit), refused by the bounds"] = body
    return out


CHILD = r"""
import json, resource, statistics, sys, time
for name in ("kubernetes", "kubernetes_asyncio", "pykube"):  # as rljob-operator does
    sys.modules.setdefault(name, None)
import kopf  # noqa: F401
from rljob.operator import handlers  # noqa: F401  (what the operator process imports)
from rljob.operator.plans import PlanCache
from rljob.recipes.render import render

from rljob.operator.plans import warm_up

text = sys.stdin.read()
runs = int(sys.argv[1])
t0 = time.perf_counter()
warm_up(render)  # what the operator's start-up does before it serves admission requests
warm_up_s = time.perf_counter() - t0
times, error = [], None
for _ in range(runs):
    t0 = time.perf_counter()
    review = json.loads(text)
    plan = PlanCache().make_plan(review["request"]["object"], render)
    times.append(time.perf_counter() - t0)
    error = plan.error
print(json.dumps({
    "warm_up_s": warm_up_s,
    "times": times,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "refused": error is not None,
    "first_problem": (error or "").splitlines()[0][:120] if error else None,
}))
"""


def review(body: dict[str, Any]) -> str:
    """The AdmissionReview the API server POSTs for a CREATE (admission.k8s.io/v1)."""
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "rljob.dev", "version": "v1alpha1", "kind": "RLJob"},
                "resource": {"group": "rljob.dev", "version": "v1alpha1", "resource": "rljobs"},
                "name": body["metadata"]["name"],
                "namespace": body["metadata"]["namespace"],
                "operation": "CREATE",
                "userInfo": {"username": "bench"},
                "object": body,
                "oldObject": None,
                "dryRun": False,
            },
        }
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    limit = chart_memory_limit_mib()
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYDANTIC_DISABLE_PLUGINS": "__all__"}
    worst_s, worst_rss = 0.0, 0.0
    for name, body in cases().items():
        text = review(body)
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, str(args.runs)],
            input=text,
            capture_output=True,
            text=True,
            env=env,
            check=True,
            cwd="/",
        )
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        context = {
            "case": name,
            "request_kib": round(len(text.encode()) / 1024, 1),
            "refused": got["refused"],
            "first_problem": got["first_problem"],
            "runs": args.runs,
        }
        median = statistics.median(got["times"])
        emit("seconds", round(median, 4), max_s=round(max(got["times"]), 4), **context)
        emit("startup_warm_up_seconds", round(got["warm_up_s"], 4), **context)
        emit("peak_rss_mib", round(got["peak_rss_mib"], 1), **context)
        worst_s, worst_rss = max(worst_s, max(got["times"])), max(worst_rss, got["peak_rss_mib"])
    emit("worst_seconds", round(worst_s, 4), budget_s=BUDGET_S, within=worst_s < BUDGET_S)
    emit("worst_peak_rss_mib", round(worst_rss, 1), chart_limit_mib=limit, within=worst_rss < limit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
