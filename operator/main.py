"""`rljob-operator`: run the operator process (in the chart's Deployment, or locally against a kubeconfig)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

# The operator image does not install the official `kubernetes` client; in a development venv where it
# is installed, kopf's optional third-party integration would import it (~28 MiB RSS). Block it so a
# local operator process measures like the image (bench/operator_scale.py reports its RSS).
for _name in ("kubernetes", "kubernetes_asyncio", "pykube"):
    sys.modules.setdefault(_name, None)  # type: ignore[arg-type]

import kopf  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rljob-operator", description=__doc__)
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="serve only these namespaces (default: $RLJOB_NAMESPACES, comma-separated; else all)",
    )
    parser.add_argument(
        "--liveness", default="http://0.0.0.0:8081/healthz", help="kopf liveness endpoint URL"
    )
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if not args.verbose:
        # kopf logs "Handler ... succeeded" per object per event at INFO: thousands of lines an hour at
        # scale that say nothing. Warnings and errors (and the operator's own INFO lines) stay.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    from rljob.operator import handlers  # noqa: F401  (registers the handlers)
    from rljob.operator.config import OperatorConfig

    # One list of namespaces for kopf's watches and the reconciler's start-up lists (handlers.on_startup
    # reads RLJOB_NAMESPACES): flags win over the environment.
    if args.namespace:
        os.environ["RLJOB_NAMESPACES"] = ",".join(args.namespace)
    namespaces = list(OperatorConfig.from_env().namespaces)

    asyncio.run(
        kopf.operator(
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces,
            liveness_endpoint=args.liveness or None,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
