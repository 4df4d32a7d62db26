"""Sweep generated RLJob manifests through ``rljob validate`` and the topology-only drill.

    .venv/bin/python -P hack/sweep.py [--n 300] [--seed 0] [--out /tmp/sweep] [--no-mesh]

The manifests come from tests/fixtures/sweep.py (model family x trainer TPU x slices x sampler layout x
LoRA x algorithm x packing, with and without a recipe). Each is written to OUT/<name>.yaml and:

1. ``rljob validate -f`` (in this process, ``rljob.cli.main.main``): exit 0 or 2, never a traceback;
   on 2, every stderr line ``spec.<field>...: message``;
2. for the accepted ones, the topology-only drill's two checks: the rendered JobSet's process topology
   (``rljob.cli.drill.full_topology``) and MaxText's full-size mesh (``python -m
   rljob.trainer.meshcheck``, run for many configs in one process per device count: MaxText is imported
   once; ``--no-mesh`` skips it), and that the full drill's scaled manifest (``drill.scaled_doc``)
   resolves.

Prints one JSON line per finding and a summary line; OUT/results.json holds every manifest's outcome.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import subprocess
import sys
import traceback
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from fixtures.sweep import manifests  # noqa: E402

LINE = re.compile(r"^(metadata|spec)(\.[A-Za-z0-9_-]+|\[\d+\])*: \S")

# One process per device count: MaxText's mesh for each config given, as rljob.trainer.meshcheck.
_BATCH = """
import contextlib, io, json, sys
from rljob.trainer import meshcheck
for cfg, per_slice in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = meshcheck.main(["--config", cfg] + (["--per-slice"] if per_slice else []))
    except BaseException as e:  # noqa: BLE001
        rc, err = 99, io.StringIO(repr(e))
    print(json.dumps({"config": cfg, "rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()[-2000:]}))
"""


def validate(path: Path) -> tuple[int, str, str]:
    from rljob.cli import main as cli

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["validate", "-f", str(path)])
    except SystemExit as e:
        code = int(e.code or 0)
    except Exception:  # a traceback is the finding
        return -1, out.getvalue(), traceback.format_exc()
    return code, out.getvalue(), err.getvalue()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="/tmp/rljob-sweep")
    p.add_argument("--no-mesh", action="store_true")
    args = p.parse_args()
    from rljob.cli import drill
    from rljob.recipes.plan import parse_manifest, resolve

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    by_devices: dict[int, list[tuple[str, bool]]] = defaultdict(list)
    for doc in manifests(args.n, args.seed):
        name = doc["metadata"]["name"]
        path = out / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
        code, _, err = validate(path)
        r: dict[str, Any] = {"name": name, "validate": code}
        results[name] = r
        if code == 2:
            lines = [x for x in err.splitlines() if x.strip()]
            r["problems"] = lines
            bad = [x for x in lines if not LINE.match(x)]
            if bad:
                r["finding"] = "refusal line names no field: " + bad[0]
            continue
        if code != 0:
            r["finding"] = f"validate exit {code}: " + err.strip().splitlines()[-1] if err.strip() else ""
            r["traceback"] = err
            continue
        rc = resolve(parse_manifest(path.read_text(encoding="utf-8")))
        try:
            r["full"] = drill.full_topology(rc)
        except drill.DrillFailed as e:
            r["finding"] = f"topology: {e}"
            continue
        small_doc, _ = drill.scaled_doc(doc, rc, steps=2)
        try:
            drill.resolve_doc(small_doc, fit_check=False)
        except drill.DrillBadInput as e:
            r["finding"] = "the full drill's scaled manifest does not resolve: " + "; ".join(e.problems)
        cfg = out / f"{name}.run.json"
        cfg.write_text(rc.model_dump_json(by_alias=True), encoding="utf-8")
        per_slice = rc.trainer.slices > 1
        by_devices[rc.trainer.tpu.devices if per_slice else rc.trainer.devices].append((str(cfg), per_slice))
        want = {a: int(getattr(rc.trainer.ici, a)) for a in drill.mesh_axes(rc)}
        r["want_mesh"] = want if per_slice else drill.mesh_axes(rc)
    if not args.no_mesh:
        for devices, cfgs in sorted(by_devices.items()):
            proc = subprocess.run(
                [drill.python(), "-c", _BATCH, json.dumps(cfgs)],
                env=drill.base_env(devices),
                capture_output=True,
                text=True,
                timeout=1800,
                cwd=out,
            )
            seen = set()
            for line in proc.stdout.splitlines():
                if not line.startswith("{"):
                    continue
                m = json.loads(line)
                name = Path(m["config"]).name.removesuffix(".run.json")
                seen.add(name)
                r = results[name]
                if m["rc"] != 0:
                    r["finding"] = f"meshcheck exit {m['rc']}: " + m["stderr"].strip()[-500:]
                    continue
                got = json.loads(m["stdout"].strip().splitlines()[-1])["mesh"]
                wrong = {a: (got.get(a, 1), n) for a, n in r["want_mesh"].items() if got.get(a, 1) != n}
                if wrong:
                    r["finding"] = f"meshcheck: MaxText built {got}, the plan says {r['want_mesh']}"
            for cfg_path, _ in cfgs:
                name = Path(cfg_path).name.removesuffix(".run.json")
                if name not in seen:
                    results[name]["finding"] = (
                        f"meshcheck batch ({devices} devices) died: {proc.stderr[-500:]}"
                    )
    (out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    findings = [r for r in results.values() if r.get("finding")]
    for r in findings:
        print(json.dumps({"name": r["name"], "finding": r["finding"]}))
    codes = Counter(r["validate"] for r in results.values())
    refusals = Counter(line.split(":")[0] for r in results.values() for line in r.get("problems", []))
    print(
        json.dumps(
            {
                "manifests": len(results),
                "accepted": codes[0],
                "refused": codes[2],
                "other": sum(v for k, v in codes.items() if k not in (0, 2)),
                "findings": len(findings),
                "refused_fields": dict(refusals.most_common()),
            }
        )
    )
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
