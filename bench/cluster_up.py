#!/usr/bin/env python3
"""Local cluster start and stop times (hack/cluster.sh), on a separate throw-away cluster.

    .venv/bin/python bench/cluster_up.py [--runs 2]

Builds what is missing first (hack/build.sh; reported as `build_s`, ~0 when the binaries are there), then
per run: `hack/cluster.sh up` (kwokctl binary runtime, 10 TPU/CPU nodes Ready, JobSet controller with its
webhooks answering; goal <= 60 s) and `hack/cluster.sh down`, in a temporary state dir so a cluster
that is already running is left alone. Checks that `down` leaves no process behind.
JSON lines {"bench": "cluster", "metric", "value", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.monotonic()
    subprocess.run(cmd, env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return time.monotonic() - start


def leftover_processes(state: str) -> int:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    return sum(1 for line in out.splitlines() if state in line and not line.startswith("ps "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    emit = {"bench": "cluster", "cpus": os.cpu_count(), "load1": round(os.getloadavg()[0], 2)}
    print(
        json.dumps(
            {
                **emit,
                "metric": "build_s",
                "value": round(timed(["bash", "hack/build.sh"], dict(os.environ)), 2),
            }
        ),
        flush=True,
    )
    ups = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="rljob-bench-cluster-") as state:
            env = {**os.environ, "RLJOB_CLUSTER_DIR": state, "RLJOB_CLUSTER_NAME": f"bench{run}"}
            up = timed(["bash", "hack/cluster.sh", "up"], env)
            down = timed(["bash", "hack/cluster.sh", "down"], env)
            time.sleep(1)
            ups.append(up)
            print(json.dumps({**emit, "metric": "warm_up_s", "value": round(up, 2), "run": run, "goal": 60}))
            print(json.dumps({**emit, "metric": "down_s", "value": round(down, 2), "run": run}))
            print(
                json.dumps(
                    {
                        **emit,
                        "metric": "leftover_processes",
                        "value": leftover_processes(state),
                        "run": run,
                        "goal": 0,
                    }
                ),
                flush=True,
            )
    print(json.dumps({**emit, "metric": "warm_up_s_max", "value": round(max(ups), 2), "goal": 60}))


if __name__ == "__main__":
    main()
