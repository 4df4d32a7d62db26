"""`rljob submit | list | status | logs | delete`: RLJobs on a cluster, with kubectl's flags.

    rljob submit -f FILE [--wait]          validate (exit 2 on a bad manifest, nothing sent), then create
    rljob list [-A] [-o wide|json|yaml]    NAME PHASE STEP REWARD RESTARTS AGE (wide: JOBSET LAST-FAILURE URL)
    rljob status NAME [-o json|yaml]       phase, step, reward, restarts, last failure, conditions, and the
                                           reward by step as a terminal sparkline (from the run's
                                           TensorBoard events under storage.root, when readable)
    rljob logs NAME [--role trainer|sampler] [-f] [--tail N]
    rljob delete NAME [--wait]

Common flags: -n/--namespace (default: the context's namespace, else default), --context, --kubeconfig.
The cluster is reached with the `kubernetes` client (the `operator` extra), imported only when a command
runs. Exit codes: 0 done, 1 the cluster refused or has no such RLJob (one line, never a traceback), 2 bad
input (the manifest, the flags, the client not installed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
import unicodedata
from datetime import UTC, datetime
from typing import Any

from rljob.recipes import failure, naming

EXIT_OK = failure.EXIT_OK  # the exit codes every entrypoint shares: rljob.recipes.failure
EXIT_CLUSTER = 1
EXIT_BAD_INPUT = failure.EXIT_BAD_CONFIG
ROLES = (naming.TRAINER, naming.SAMPLER)
TERMINAL = ("Succeeded", "Failed")
SPARK = "▁▂▃▄▅▆▇█"


class JobError(Exception):
    """One line for the user and the exit code."""

    def __init__(self, message: str, code: int = EXIT_CLUSTER) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------------------- formatting


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: every control or format character (an escape sequence's ESC,
    a carriage return, a bidi override) written as its escape (``\\x1b``, ``\\u202e``), a newline or tab as
    a space. A status message can hold a container's log (terminationMessagePolicy FallbackToLogsOnError):
    printed raw, its escapes would drive the reader's terminal and its newlines forge lines of the output."""
    out = []
    for ch in text:
        if ch in "\n\t":
            out.append(" ")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            out.append(ascii(ch)[1:-1])
        else:
            out.append(ch)
    return "".join(out)


def printable_tree(value: Any) -> Any:
    """``value`` (an API object) with every string in it, keys included, made printable."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_tree(k): printable_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable_tree(v) for v in value]
    return value


def sparkline(values: list[float], width: int = 60) -> str:
    """One character per value (the last `width` values, bucketed evenly when there are more), scaled
    from the minimum to the maximum; a flat series is drawn at the middle."""
    if not values:
        return ""
    if len(values) > width:
        size = len(values) / width
        values = [
            sum(chunk) / len(chunk)
            for chunk in (
                values[int(i * size) : max(int((i + 1) * size), int(i * size) + 1)] for i in range(width)
            )
        ]
    lo, hi = min(values), max(values)
    if hi == lo:
        return SPARK[len(SPARK) // 2] * len(values)
    top = len(SPARK) - 1
    return "".join(SPARK[round((v - lo) / (hi - lo) * top)] for v in values)


def age(timestamp: str | None, now: datetime | None = None) -> str:
    """kubectl's short age: 45s, 12m, 3h, 2d."""
    if not timestamp:
        return "<unknown>"
    then = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = int(((now or datetime.now(UTC)) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size or (unit == "m" and seconds >= size):
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _reward(progress: dict[str, Any]) -> str:
    reward = progress.get("rewardMean")
    return "" if reward is None else f"{reward:.3f}"


def table(items: list[dict[str, Any]], wide: bool = False, all_namespaces: bool = False) -> str:
    head = ["NAME", "PHASE", "STEP", "REWARD", "RESTARTS", "AGE"]
    if all_namespaces:
        head.insert(0, "NAMESPACE")
    if wide:
        head += ["JOBSET", "LAST-FAILURE", "URL"]
    rows = [head]
    for obj in printable_tree(items):
        meta, status = obj.get("metadata") or {}, obj.get("status") or {}
        progress = status.get("progress") or {}
        row = [
            meta.get("name", ""),
            status.get("phase") or "",
            str(progress.get("step", "")),
            _reward(progress),
            str((status.get("restarts") or {}).get("used", 0)),
            age(meta.get("creationTimestamp")),
        ]
        if all_namespaces:
            row.insert(0, meta.get("namespace", ""))
        if wide:
            row += [
                status.get("jobSetName") or "",
                (status.get("lastFailure") or {}).get("class") or "",
                status.get("url") or "",
            ]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return (
        "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
        + "\n"
    )


def _steps(obj: dict[str, Any]) -> Any:
    """spec.algorithm.steps of an RLJob object as the plan merges it (manifest over the recipe over the
    defaults table); "?" for an object that does not parse as an RLJob."""
    from pydantic import ValidationError
    from rljob.recipes import spec_layers
    from rljob.recipes.api import RLJob

    try:
        job = RLJob.model_validate({"metadata": obj.get("metadata") or {}, "spec": obj.get("spec") or {}})
    except ValidationError:
        return "?"
    merged, _, _ = spec_layers.merged_spec(job)
    return merged["algorithm"]["steps"]


def _sampler_restarts(restarts: dict[str, Any], sampler_failure: str | None = None) -> str:
    """`; sampler N used, M left` when the status counts sampler restarts apart (rljob >= JobSet v0.12);
    ` (the run, sampler crashes included)` when a sampler crash restarts the run (samplerFailure
    RestartRun: JobSet's feature gate RestartJob off)."""
    from rljob.recipes.failure import SamplerFailure

    if sampler_failure == SamplerFailure.RESTART_RUN:
        return " (the run, sampler crashes included: JobSet's gate RestartJob is off)"
    sampler = restarts.get("sampler")
    if not isinstance(sampler, dict):
        return ""
    return f" (the run); sampler {sampler.get('used', 0)} used, {sampler.get('left', '?')} left"


def _evaluation(ev: dict[str, Any]) -> str:
    """The newest held-out evaluation (ProgressReport.evaluation) as `rljob status` shows it."""
    out = f"step {ev.get('step')}: pass@{ev.get('passK')} {ev.get('passAtK', 0):.3f}"
    if ev.get("majK"):
        out += f", maj@{ev['majK']} {ev.get('majAtK', 0):.3f}"
    return out + f", mean reward {ev.get('rewardMean', 0):.3f}"


def describe(
    obj: dict[str, Any], history: list[tuple[int, float]] | None, history_note: str = "", profile: str = ""
) -> str:
    """The human-readable status of one RLJob; every string from the cluster made printable."""
    obj = printable_tree(obj)
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    progress = status.get("progress") or {}
    restarts = status.get("restarts") or {}
    steps = _steps(obj)
    lines = [
        f"Name:        {meta.get('namespace')}/{meta.get('name')}",
        f"Phase:       {status.get('phase') or 'Pending'}",
        f"Step:        {progress.get('step', 0)} of {steps}",
        f"Reward:      {_reward(progress) or '-'}",
        f"Restarts:    {restarts.get('used', 0)} used, {restarts.get('left', '?')} left"
        + _sampler_restarts(restarts, status.get("samplerFailure")),
    ]
    if progress.get("message"):
        lines.append(f"Trainer:     {progress['message']}")
    if progress.get("lastCheckpointStep") is not None:
        lines.append(f"Checkpoint:  step {progress['lastCheckpointStep']}")
    if progress.get("evaluation"):
        lines.append(f"Evaluation:  {_evaluation(progress['evaluation'])}")
    if profile:
        lines.append(f"Profile:     {profile}")
    if status.get("jobSetName"):
        lines.append(f"JobSet:      {status['jobSetName']}")
    if status.get("url"):
        lines.append(f"URL:         {status['url']}")
    roles = status.get("roles") or {}
    if roles:
        lines.append(
            "Pods:        "
            + ", ".join(
                f"{r} {(roles.get(r) or {}).get('ready', 0)}/{(roles.get(r) or {}).get('total', 0)} ready"
                for r in ROLES
            )
        )
    failure = status.get("lastFailure")
    if failure:
        lines.append(
            f"Last failure: {failure.get('class')} {failure.get('reason', '')}"
            f"{' of the ' + failure['role'] if failure.get('role') else ''} at "
            f"{failure.get('time', '?')}: {failure.get('message', '')}".rstrip(": ")
        )
    conditions = status.get("conditions") or []
    if conditions:
        lines.append("Conditions:")
        for c in conditions:
            lines.append(
                f"  {c.get('type')}={c.get('status')} {c.get('reason', '')}: {c.get('message', '')}".rstrip(
                    ": "
                )
            )
    if history:
        rewards = [r for _, r in history]
        lines.append(
            f"Reward by step ({history[0][0]}..{history[-1][0]}, min {min(rewards):.3f}, "
            f"max {max(rewards):.3f}):"
        )
        lines.append(f"  {sparkline(rewards)}")
    elif history_note:
        lines.append(f"Reward by step: {history_note}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ cluster


class Session:
    """The kubernetes client of one command: its namespace, API clients and error translation."""

    def __init__(self, args: argparse.Namespace) -> None:
        try:
            from kubernetes import client, config
        except ImportError:
            raise JobError(
                "the kubernetes client is not installed: pip install 'rljob[operator]'", EXIT_BAD_INPUT
            ) from None
        self.client = client
        namespace = "default"
        try:
            config.load_kube_config(config_file=args.kubeconfig, context=args.context)  # type: ignore[no-untyped-call]
            contexts, active = config.list_kube_config_contexts(config_file=args.kubeconfig)  # type: ignore[no-untyped-call]
            if args.context:
                active = next((c for c in contexts if c["name"] == args.context), active)
            namespace = (active or {}).get("context", {}).get("namespace") or "default"
        except config.ConfigException as e:
            try:
                config.load_incluster_config()  # type: ignore[no-untyped-call]
            except config.ConfigException:
                raise JobError(f"no cluster configured: {e}", EXIT_BAD_INPUT) from None
        self.namespace: str = args.namespace or namespace
        self.api = client.ApiClient()
        self.custom = client.CustomObjectsApi(self.api)
        self.core = client.CoreV1Api(self.api)

    def call(self, what: str, fn: Any, *a: Any, **kw: Any) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(*a, **kw)
        except ApiException as e:
            reason = e.reason
            with contextlib.suppress(ValueError, AttributeError):
                reason = json.loads(e.body or "{}").get("message") or reason
            raise JobError(f"{what}: {reason} (HTTP {e.status})") from None
        except (HTTPError, OSError) as e:
            raise JobError(f"{what}: cannot reach the cluster: {e}") from None

    def get(self, name: str) -> dict[str, Any]:
        from rljob.recipes.api import GROUP, PLURAL, VERSION

        out: dict[str, Any] = self.call(
            f"rljob {self.namespace}/{name}",
            self.custom.get_namespaced_custom_object,
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            name,
        )
        return out


def _emit(obj: Any, output: str) -> None:
    if output == "json":
        sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    else:
        import yaml

        sys.stdout.write(yaml.safe_dump(obj, sort_keys=False))


def cmd_submit(args: argparse.Namespace) -> int:
    from rljob.cli.main import _job, _resolve
    from rljob.recipes.api import GROUP, PLURAL, VERSION

    job = _job(args.file)
    if (
        args.namespace
        and "namespace" in job.metadata.model_fields_set
        and job.metadata.namespace != args.namespace
    ):
        raise JobError(
            f"metadata.namespace: {job.metadata.namespace} differs from -n {args.namespace}", EXIT_BAD_INPUT
        )
    s = Session(args)
    job.metadata.namespace = args.namespace or (
        job.metadata.namespace if "namespace" in job.metadata.model_fields_set else s.namespace
    )
    _resolve(job, args)  # every problem at once, exit 2, before anything is sent
    body = job.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude_none=True)
    body["metadata"]["namespace"] = job.metadata.namespace
    body.pop("status", None)
    ns, name = job.metadata.namespace, job.metadata.name
    created = s.call(
        f"rljob {ns}/{name}", s.custom.create_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, body
    )
    if args.output in ("json", "yaml"):
        _emit(created, args.output)
    else:
        print(f"rljob.{GROUP}/{name} created in {ns}")
    if args.wait:
        s.namespace = ns
        return _wait(s, name, args.timeout)
    return EXIT_OK


def _wait(s: Session, name: str, timeout: float) -> int:
    """Print each change of phase, step and ready pods on stderr until the RLJob runs or ends."""
    start = time.monotonic()
    last = None
    while True:
        status = printable_tree(s.get(name).get("status") or {})
        phase = status.get("phase") or "Pending"
        roles = status.get("roles") or {}
        ready = " ".join(
            f"{r} {(roles.get(r) or {}).get('ready', 0)}/{(roles.get(r) or {}).get('total', 0)}"
            for r in ROLES
        )
        step = (status.get("progress") or {}).get("step")
        now = (phase, ready, step)
        if now != last:
            print(
                f"[{time.monotonic() - start:5.0f}s] {name}: {phase}, pods {ready}"
                + (f", step {step}" if step is not None else ""),
                file=sys.stderr,
                flush=True,
            )
            last = now
        if phase in TERMINAL or phase == "Running":
            return EXIT_OK if phase != "Failed" else EXIT_CLUSTER
        if time.monotonic() - start > timeout:
            raise JobError(f"rljob {s.namespace}/{name}: still {phase} after {timeout:.0f}s")
        time.sleep(1)


def cmd_list(args: argparse.Namespace) -> int:
    from rljob.recipes.api import GROUP, PLURAL, VERSION

    s = Session(args)
    if args.all_namespaces:
        out = s.call("rljobs", s.custom.list_cluster_custom_object, GROUP, VERSION, PLURAL)
    else:
        out = s.call(
            f"rljobs in {s.namespace}",
            s.custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            s.namespace,
            PLURAL,
        )
    items = sorted(
        out.get("items") or [], key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"])
    )
    if args.output in ("json", "yaml"):
        _emit({"apiVersion": "v1", "kind": "List", "items": items}, args.output)
    elif not items:
        print(
            f"No rljobs found in {'any namespace' if args.all_namespaces else s.namespace}.", file=sys.stderr
        )
    else:
        sys.stdout.write(table(items, wide=args.output == "wide", all_namespaces=args.all_namespaces))
    return EXIT_OK


def reward_history(obj: dict[str, Any]) -> tuple[list[tuple[int, float]], str]:
    """(step, mean reward) pairs from the run's TensorBoard events, and why there are none."""
    from rljob.cli import metrics

    return metrics.reward_history(obj)


def cmd_status(args: argparse.Namespace) -> int:
    s = Session(args)
    obj = s.get(args.name)
    if args.output in ("json", "yaml"):
        _emit(obj, args.output)
        return EXIT_OK
    from rljob.cli import metrics

    history, note = reward_history(obj)
    sys.stdout.write(describe(obj, history, note, metrics.profile_note(obj)))
    return EXIT_OK


def _pods(s: Session, name: str, role: str) -> list[Any]:
    pods = s.call(
        f"pods of rljob {s.namespace}/{name}",
        s.core.list_namespaced_pod,
        s.namespace,
        label_selector=f"{naming.RUN_LABEL}={name},{naming.ROLE_LABEL}={role}",
    ).items
    return sorted(pods, key=lambda p: p.metadata.name)


def cmd_logs(args: argparse.Namespace) -> int:
    s = Session(args)
    s.get(args.name)  # a missing RLJob is named as such, not as "no pods"
    pods = _pods(s, args.name, args.role)
    if not pods:
        raise JobError(f"rljob {s.namespace}/{args.name}: no {args.role} pods (yet)")
    streams = [(p.metadata.name, c.name) for p in pods for c in p.spec.containers]
    prefix = len(streams) > 1
    lock = threading.Lock()
    errors: list[str] = []

    def one(pod: str, container: str) -> None:
        tag = f"[{pod}/{container}] " if prefix else ""
        kw: dict[str, Any] = {"container": container}
        if args.tail is not None:
            kw["tail_lines"] = args.tail
        try:
            if args.follow:
                resp: Any = s.core.read_namespaced_pod_log(
                    pod, s.namespace, follow=True, _preload_content=False, **kw
                )
                for raw in resp.stream():
                    with lock:
                        for line in raw.decode("utf-8", "replace").splitlines():
                            print(f"{tag}{line}", flush=True)
            else:
                text = s.call(
                    f"logs of {pod}/{container}",
                    s.core.read_namespaced_pod_log,
                    pod,
                    s.namespace,
                    _request_timeout=60,
                    **kw,
                )
                with lock:
                    for line in (text or "").splitlines():
                        print(f"{tag}{line}")
        except JobError as e:
            errors.append(str(e))
        except Exception as e:  # the client's streaming errors: one line per stream
            errors.append(f"logs of {pod}/{container}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=st, daemon=True) for st in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for line in errors:
        print(line, file=sys.stderr)
    return EXIT_CLUSTER if errors else EXIT_OK


def cmd_delete(args: argparse.Namespace) -> int:
    from rljob.recipes.api import GROUP, PLURAL, VERSION

    s = Session(args)
    s.call(
        f"rljob {s.namespace}/{args.name}",
        s.custom.delete_namespaced_custom_object,
        GROUP,
        VERSION,
        s.namespace,
        PLURAL,
        args.name,
        propagation_policy="Foreground",
    )
    print(f"rljob.{GROUP}/{args.name} deleted from {s.namespace}")
    if args.wait:
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            try:
                s.get(args.name)
            except JobError:
                return EXIT_OK
            time.sleep(1)
        raise JobError(f"rljob {s.namespace}/{args.name}: still there after {args.timeout:.0f}s")
    return EXIT_OK


# ------------------------------------------------------------------------------------------ parser


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--namespace", help="namespace (default: the context's, else default)")
    p.add_argument("--context", help="kubeconfig context")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster)")


def register(sub: Any) -> None:
    """Add the job commands to the `rljob` command's subparsers (called by rljob.cli.main)."""
    p = sub.add_parser(
        "submit",
        help="validate a manifest and create the RLJob",
        description="validate a manifest and create the RLJob",
    )
    p.add_argument("-f", "--file", required=True, help="RLJob manifest (YAML), or - for stdin")
    p.add_argument("--wait", action="store_true", help="show progress until the RLJob runs or ends")
    p.add_argument("--timeout", type=float, default=600, help="seconds --wait waits (default 600)")
    p.add_argument("-o", "--output", choices=("name", "json", "yaml"), default="name")
    _common(p)
    p.set_defaults(fn=cmd_submit)

    p = sub.add_parser("list", help="the RLJobs of a namespace", description="the RLJobs of a namespace")
    p.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    p.add_argument("-o", "--output", choices=("table", "wide", "json", "yaml"), default="table")
    _common(p)
    p.set_defaults(fn=cmd_list)

    p = sub.add_parser(
        "status",
        help="one RLJob: phase, progress, failures, reward by step",
        description="one RLJob: phase, progress, failures, reward by step",
    )
    p.add_argument("name")
    p.add_argument("-o", "--output", choices=("text", "json", "yaml"), default="text")
    _common(p)
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser(
        "logs",
        help="the logs of an RLJob's pods",
        description="the logs of an RLJob's pods (every pod of the role; prefixed when several)",
    )
    p.add_argument("name")
    p.add_argument("--role", choices=ROLES, default="trainer", help="trainer (default) or sampler")
    p.add_argument("-f", "--follow", action="store_true", help="stream new lines")
    p.add_argument("--tail", type=int, help="lines from the end of each log")
    _common(p)
    p.set_defaults(fn=cmd_logs)

    p = sub.add_parser(
        "delete",
        help="delete an RLJob (its JobSet and pods go with it)",
        description="delete an RLJob (its JobSet and pods go with it)",
    )
    p.add_argument("name")
    p.add_argument("--wait", action="store_true", help="wait until it is gone")
    p.add_argument("--timeout", type=float, default=120, help="seconds --wait waits (default 120)")
    _common(p)
    p.set_defaults(fn=cmd_delete)
