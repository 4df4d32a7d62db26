"""`rljob doctor [--for FILE]`: check a cluster for what an RLJob needs; print what is missing and how
to fix it.

This module is the command line only and imports nothing heavy, so `rljob --help` stays fast. The
checks are pure functions over plain Kubernetes objects (the JSON the API server returns), one module
per group, table-tested without a cluster (tests/doctor/):

- `jobset`: the CRD serves v1alpha2 with every field rljob renders, the controller runs, its webhooks
  answer (a server-side dry-run of a tiny JobSet comes back defaulted);
- `nodepools`: TPU node pools for the manifest's trainer and sampler shapes (JobSet's exclusive
  placement puts every slice on a pool of its own; roles with the same shape add up);
- `kueue`: the LocalQueue named by spec.queueName exists and is active, and Kueue's WaitForPodsReady
  timeout (its ConfigMap kueue-system/kueue-manager-config) leaves the run's pods time to be ready;
- `operator_checks`: the RLJob CRD, the operator's Deployment, its ServiceAccount's RBAC
  (SubjectAccessReview per permission), its validating webhook, and whether you may create RLJobs;
- `needs`: what the manifest needs (resolved by the same plan `rljob render` uses) and the objects its
  pod overrides name;
- `cluster`: reads all of that with the `kubernetes` client (the `operator` extra), imported only when
  the command runs: render, validate and plan work without it.

Exit codes: 0 nothing missing (warnings allowed), 1 problems found, 2 bad input (the manifest, or
the kubernetes client not installed).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rljob.recipes import failure

EXIT_OK = failure.EXIT_OK  # the exit codes every entrypoint shares: rljob.recipes.failure
EXIT_PROBLEMS = 1
EXIT_BAD_INPUT = failure.EXIT_BAD_CONFIG
# `helm install rljob charts/rljob -n rljob-system`: the chart names the ServiceAccount
# <release>-rljob-operator. Used when no ServiceAccount carries the chart's label.
DEFAULT_OPERATOR_NAMESPACE = "rljob-system"
DEFAULT_OPERATOR_SERVICE_ACCOUNT = "rljob-rljob-operator"
HELP = "check a cluster for what an RLJob needs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--for",
        dest="manifest",
        metavar="FILE",
        type=Path,
        help="an RLJob manifest (or - for stdin): also check its TPU node pools and Kueue queue",
    )
    parser.add_argument(
        "--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster)"
    )
    parser.add_argument("--context", help="kubeconfig context")
    parser.add_argument(
        "--operator-namespace",
        help="namespace of the rljob operator (default: found by the chart's labels, else "
        f"{DEFAULT_OPERATOR_NAMESPACE})",
    )
    parser.add_argument(
        "--operator-service-account",
        help="the operator's ServiceAccount (default: found by the chart's labels, else "
        f"{DEFAULT_OPERATOR_SERVICE_ACCOUNT})",
    )
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text", help="report format")


def register(subparsers: Any) -> None:
    """Add `doctor` to the `rljob` command's subparsers (called by rljob.cli.main)."""
    parser = subparsers.add_parser(
        "doctor",
        help=HELP,
        description=f"{HELP[0].upper()}{HELP[1:]}; print what is missing and how to fix it. "
        "Exit 0: nothing missing; 1: problems found; 2: bad input.",
    )
    add_arguments(parser)
    parser.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from rljob.cli.doctor.cluster import ClusterError, gather, run_checks
    from rljob.cli.doctor.findings import exit_code, problem, render_text
    from rljob.cli.doctor.needs import BadInput, needs_from_manifest

    try:
        needs = needs_from_manifest(args.manifest) if args.manifest else None
    except BadInput as exc:
        print(exc, file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        print(
            "rljob doctor needs the kubernetes client, which is not installed: "
            "pip install 'rljob[operator]' (render, validate and plan work without it)",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    server = ""
    try:
        state = gather(
            needs, args.kubeconfig, args.context, args.operator_namespace, args.operator_service_account
        )
    except ClusterError as exc:
        findings = [problem("cluster", str(exc), "check KUBECONFIG / --kubeconfig / --context")]
    else:
        server = state.server
        findings = run_checks(state, needs)
    code = exit_code(findings)
    if args.output == "json":
        report = {"server": server, "findings": [asdict(f) for f in findings], "exitCode": code}
        print(json.dumps(report, indent=2))
    else:
        what = f" for RLJob {needs.namespace}/{needs.name}" if needs else ""
        print(f"rljob doctor: cluster {server or '?'}{what}")
        print(render_text(findings))
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rljob doctor", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
