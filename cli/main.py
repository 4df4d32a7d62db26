"""The `rljob` command line.

    rljob render -f FILE       every object of the job as a YAML stream (what the operator applies)
    rljob validate -f FILE     check a manifest; exit 0 when it would run
    rljob plan -f FILE         hosts, chips, devices, mesh, sampler TP, every MaxText key and its source
    rljob recipes list         the catalog
    rljob recipes show NAME    one recipe, as its file
    rljob submit | list | status | logs | delete   RLJobs on a cluster (rljob.cli.jobs)
    rljob drill -f FILE        rehearse it on this machine (also --recipe NAME [--profile P], --all)

Bad input exits 2 and prints one line per problem, `spec.path: message`, on stderr; never a
traceback. FILE may be `-` for stdin. Imports are lazy so `rljob --help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from rljob.recipes import failure, naming, quantization

if TYPE_CHECKING:
    from rljob.recipes.api import RLJob
    from rljob.recipes.podpolicy import PodPolicy
    from rljob.recipes.runconfig import RunConfig

EXIT_OK = failure.EXIT_OK  # the exit codes every entrypoint shares: rljob.recipes.failure
EXIT_INTERNAL = 1
EXIT_BAD_INPUT = failure.EXIT_BAD_CONFIG


class _BadInput(Exception):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"rljob: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise _BadInput([f"{path}: no such file"]) from None
    except IsADirectoryError:
        raise _BadInput([f"{path}: is a directory"]) from None
    except PermissionError:
        raise _BadInput([f"{path}: permission denied"]) from None
    except UnicodeDecodeError:
        raise _BadInput([f"{path}: not UTF-8 text"]) from None


def _job(path: str) -> RLJob:
    from rljob.recipes.plan import PlanError, parse_manifest

    try:
        return parse_manifest(_read(path))
    except PlanError as e:
        raise _BadInput(e.problems) from None


def _policy(path: str | None) -> PodPolicy:
    """The operator's pod policy from --pod-policy FILE (YAML or JSON, the chart's `podPolicy` values), or
    the default one."""
    from rljob.recipes import podpolicy

    if not path:
        return podpolicy.DEFAULT
    import yaml

    try:
        data = yaml.safe_load(_read(path))
    except yaml.YAMLError as e:
        raise _BadInput([f"{path}: not YAML: {' '.join(str(e).split())}"]) from None
    try:
        return podpolicy.parse(data, path)
    except podpolicy.PolicyError as e:
        raise _BadInput(e.problems) from None


def _resolve(job: RLJob, args: argparse.Namespace) -> RunConfig:
    """The plan of `job` under the flags --pod-policy and --jobset-restart-job."""
    from rljob.recipes.plan import PlanError, resolve

    policy = _policy(getattr(args, "pod_policy", None))
    restart_job = getattr(args, "jobset_restart_job", "enabled") == "enabled"
    try:
        return resolve(job, policy, restart_job=restart_job)
    except PlanError as e:
        raise _BadInput(e.problems) from None


def cmd_render(args: argparse.Namespace) -> int:
    from rljob.recipes import render

    run = _resolve(_job(args.file), args)
    sys.stdout.write(render.to_yaml(render.objects(run)))
    return EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    from rljob.recipes import render

    run = _resolve(_job(args.file), args)
    render.jobset(run)
    print(
        f"{args.file}: valid: JobSet {run.namespace}/{run.job_set_name}, trainer {run.trainer.tpu.type_name} "
        f"x {run.trainer.slices}, sampler {run.sampler.tpu.type_name} x {run.sampler.replicas}"
    )
    return EXIT_OK


def _mesh(m: Any) -> str:
    from rljob.recipes.runconfig import MESH_AXES

    return " x ".join(f"{a} {getattr(m, a)}" for a in MESH_AXES if getattr(m, a) != 1) or "1 (no parallelism)"


def _dataset(run: RunConfig) -> str:
    d = run.spec.dataset
    graded = f", rewards from {d.reward_url}" if d.reward_url else ""
    if d.task == "successor":
        reward = graded or ", exact-match reward"
        return f"successor (the CPU toy task: token prompts{reward})"
    if d.task == "math":
        reward = graded or ", math-verify reward"
        return f"math problems from {d.path} ({d.eval_size} held out for evaluation){reward}"
    opts = f", options {', '.join(f'{k}={v}' for k, v in sorted(d.options.items()))}" if d.options else ""
    return (
        f"task {d.task} of the trainer image (entry-point group rljob.tasks), data {d.path} "
        f"({d.eval_size} held out for evaluation){opts}{graded}"
    )


def _vllm_support(accelerator: str) -> str:
    from rljob.recipes.tpu import BY_ACCELERATOR

    gen = BY_ACCELERATOR[accelerator]
    if gen.vllm_tpu_support == "experimental":
        recommended = [g.prefix for g in BY_ACCELERATOR.values() if g.vllm_tpu_support == "recommended"]
        return f"{gen.prefix} is experimental there (recommended: {', '.join(recommended)})"
    return f"{gen.prefix} is {gen.vllm_tpu_support}"


def _overrides(template: Any) -> str:
    """One line of what a role's pod template adds (docs/pod-overrides.md)."""
    if template is None:
        return ""
    parts = []
    meta, pod = template.metadata, template.spec
    if meta and meta.labels:
        parts.append(f"labels {', '.join(meta.labels)}")
    if meta and meta.annotations:
        parts.append(f"annotations {', '.join(meta.annotations)}")
    if pod is not None:
        env = []
        for e in pod.env or []:
            ref = (e.value_from or {}).get("secretKeyRef")
            env.append(
                f"{e.name} (Secret {ref.get('name')}/{ref.get('key')})" if isinstance(ref, dict) else e.name
            )
        if env:
            parts.append(f"env {', '.join(env)}")
        if pod.env_from:
            parts.append(f"envFrom x{len(pod.env_from)}")
        if pod.volumes:
            kinds = [f"{v.get('name')} ({next((k for k in v if k != 'name'), '?')})" for v in pod.volumes]
            parts.append(f"volumes {', '.join(kinds)}")
        if pod.volume_mounts:
            parts.append(f"mounts {', '.join(m.mount_path for m in pod.volume_mounts)}")
        if pod.resources:
            res = {**(pod.resources.requests or {}), **(pod.resources.limits or {})}
            parts.append(f"resources {', '.join(res)}")
        if pod.node_selector:
            parts.append(f"nodeSelector {', '.join(f'{k}={v}' for k, v in pod.node_selector.items())}")
        if pod.tolerations:
            parts.append(f"tolerations {', '.join(t.key or '*' for t in pod.tolerations)}")
        if pod.affinity:
            parts.append(f"affinity {', '.join(pod.affinity)}")
        if pod.service_account_name:
            parts.append(f"serviceAccount {pod.service_account_name}")
    return "; ".join(parts)


def explain(run: RunConfig) -> str:
    """The human-readable plan of a resolved run."""
    t, s = run.trainer, run.sampler
    spec = run.spec
    lines = [
        f"RLJob {run.namespace}/{run.name} -> JobSet {run.job_set_name}"
        + (
            f" (recipe {spec.recipe}"
            + (f", profile {spec.trainer.profile})" if spec.trainer.profile else ")")
            if spec.recipe
            else ""
        ),
        f"model: {spec.model.name}@{spec.model.revision} (MaxText {spec.model.maxtext_model})",
        "  base weights: "
        + (
            f"{spec.model.checkpoint} (spec.model.checkpoint)"
            if spec.model.checkpoint
            else f"{spec.model.name}@{spec.model.revision} from Hugging Face, converted by the trainer "
            f"once into {run.storage.converted}"
        ),
        f"  sampler serves: {spec.sampler.weights.name}@{spec.sampler.weights.revision} "
        f"({spec.sampler.weights.quantization}"
        + (
            f", a quantized checkpoint of {spec.model.name}"
            if spec.sampler.weights.quantization != quantization.BFLOAT16
            else ""
        )
        + f"; step-0 parity gate {spec.sampler.weights.parity_tolerance:g} nats)",
        "trainer:",
        f"  tpu: {t.tpu.type_name} = {t.tpu.accelerator} {t.tpu.topology}, machine {t.tpu.machine_type}",
        f"  per slice: {t.tpu.chips} chips, {t.tpu.hosts} hosts, {t.tpu.devices} JAX devices "
        f"({t.tpu.devices_per_chip} per chip), {t.tpu.containers_per_host} container(s) x "
        f"{t.tpu.chips_per_container} chips per host",
        f"  slices: {t.slices} -> {t.chips} chips, {t.hosts} hosts, {t.devices} devices",
        f"  mesh ici: {_mesh(t.ici)}",
        f"  mesh dcn: {_mesh(t.dcn)}",
        f"  micro-batch: {t.micro_batch_size} rows x {spec.packing.token_budget} tokens",
        f"  compile preflight: {_preflight(run)}",
        "sampler:",
        f"  tpu: {s.tpu.type_name} = {s.tpu.accelerator} {s.tpu.topology}, {s.tpu.chips} chips, "
        f"{s.tpu.hosts} hosts, {s.tpu.devices} devices per replica",
        f"  replicas: {s.replicas}, tensor x expert x data parallel {s.tensor_parallel} x "
        f"{s.expert_parallel} x {s.data_parallel}, max model len {s.max_model_len}",
        f"  vLLM TPU backend (tpu-inference): {_vllm_support(s.tpu.accelerator)}",
        f"  lora: rank {spec.lora.rank}, alpha {spec.lora.alpha:g}, max loras {s.max_loras}, targets "
        f"{', '.join(spec.lora.targets)}",
        f"algorithm: {spec.algorithm.loss}, {spec.algorithm.groups_per_batch} groups x "
        f"{spec.algorithm.group_size} completions, {spec.algorithm.steps} steps, "
        f"lr {spec.algorithm.learning_rate:g}{_schedule(spec.algorithm)}",
        f"dataset: {_dataset(run)}",
        f"storage: {run.storage.root}",
        *_restarts(run),
        f"endpoints: coordinator {run.endpoints.coordinator}; samplers {', '.join(run.endpoints.samplers)}",
        f"MaxText {t.maxtext_version} keys ({len(t.maxtext)}; source: rljob < recipe < profile < manifest):",
    ]
    from rljob.recipes import disk, fit, loop_options

    # Bytes per device of each role against its HBM (rljob.recipes.fit: the plan's fit check), then each
    # host's cache disk (rljob.recipes.disk).
    at = next(i for i, line in enumerate(lines) if line.startswith("algorithm: "))
    lines[at + 1 : at + 1] = loop_options.summary(spec)
    lines[at:at] = [
        *fit.summary(fit.of_run(run), s),
        disk.summary("trainer", t.cache_disk),
        disk.summary("sampler", s.cache_disk),
    ]
    svc = spec.service
    if svc is not None:  # service mode: the trainer serves an API instead of the loop above
        from rljob.recipes import render

        lines.insert(
            lines.index(f"dataset: {_dataset(run)}"),
            f"service: {svc.api} API at {render.api_url(run)}, up to {svc.max_training_clients} training "
            f"clients, checkpoint every {svc.checkpoint_every} steps (no built-in RL loop)",
        )
    for role in (naming.TRAINER, naming.SAMPLER):
        summary = _overrides(getattr(spec, role).template)
        if summary:
            lines.insert(lines.index(f"dataset: {_dataset(run)}"), f"{role} pod overrides: {summary}")
    width = max((len(k) for k in t.maxtext), default=0)
    for k, v in t.maxtext.items():
        lines.append(f"  {k:<{width}}  {v!s:<24} [{t.maxtext_sources.get(k, '?')}]")
    lines += _derived(run)
    return "\n".join(lines) + "\n"


def _restarts(run: RunConfig) -> list[str]:
    """The failure policy in force (rljob.recipes.failure) as the plan text shows it."""
    from rljob.recipes import failure
    from rljob.recipes.failure import SamplerFailure

    fp = run.spec.failure_policy
    if run.sampler_failure is SamplerFailure.RESTART_SAMPLER_JOB:
        budgets = (
            f"{fp.max_restarts} counted of the run (a trainer crash), {fp.max_sampler_restarts} of single "
            "sampler Jobs (a sampler crash; the trainer keeps running)"
        )
    else:
        budgets = f"{fp.max_restarts} counted of the run (a trainer or sampler crash)"
    return [
        f"restarts: {budgets}; preemption/maintenance restarts are free; exit 2 fails at once",
        f"  sampler failure: {run.sampler_failure} ({failure.explain(run.sampler_failure)})",
    ]


def _preflight(run: RunConfig) -> str:
    """spec.trainer.preflight as the plan text shows it."""
    pf = run.spec.trainer.preflight
    if not pf.compile:
        return "off (spec.trainer.preflight.compile)"
    from rljob.recipes import naming, render

    return (
        f"Job {naming.preflight_job(run.name, render.preflight_digest(run))} (trainer image, CPU only: "
        f"{pf.cpu} CPU, {pf.memory} memory) compiles the trainer's programs for "
        f"{run.trainer.tpu.type_name} x {run.trainer.slices} before the JobSet is created; a program that "
        "does not fit refuses the run"
    )


def _derived(run: RunConfig) -> list[str]:
    """The values the plan derived (source derived: unset, and the default would not run), each with its
    value and reason; set the field in the manifest to choose another."""
    if not run.derived:
        return []
    out = [f"derived ({len(run.derived)}; unset, and the default would not run; set the field to choose):"]
    for path, why in run.derived.items():
        out.append(f"  {path} = {_derived_value(run, path)} [derived]: {why}")
    return out


def _derived_value(run: RunConfig, path: str) -> str:
    """The resolved value of a derived spec path (spec.trainer.maxtext.<key> or a field of the resolved
    spec / sampler plan)."""
    prefix = "spec.trainer.maxtext."
    if path.startswith(prefix):
        return str(run.trainer.maxtext.get(path[len(prefix) :], "?"))
    node: Any = run.spec.model_dump(by_alias=True)
    for part in path.split(".")[1:]:
        node = node.get(part) if isinstance(node, dict) else None
    return "?" if node is None else str(node)


def _schedule(alg: Any) -> str:
    """The learning-rate warm-up and decay of spec.algorithm, as the plan text shows them."""
    out = f", warm-up {alg.warmup_steps} steps" if alg.warmup_steps else ""
    return out + (f", {alg.learning_rate_schedule} decay" if alg.learning_rate_schedule != "constant" else "")


def cmd_plan(args: argparse.Namespace) -> int:
    run = _resolve(_job(args.file), args)
    if args.output == "json":
        sys.stdout.write(run.model_dump_json(indent=2, exclude_none=True) + "\n")
    else:
        sys.stdout.write(explain(run))
    return EXIT_OK


def cmd_recipes_list(args: argparse.Namespace) -> int:
    from rljob.recipes import recipe_catalog

    for name in recipe_catalog.names():
        r = recipe_catalog.load(name)
        first = r.description.split(". ")[0].rstrip(".")
        profiles = f" [profiles: {', '.join(r.profiles)}]" if r.profiles else ""
        print(f"{name}: {first}{profiles}")
    return EXIT_OK


def cmd_recipes_show(args: argparse.Namespace) -> int:
    from rljob.recipes import recipe_catalog

    try:
        sys.stdout.write(recipe_catalog.source(args.name))
    except KeyError:
        raise _BadInput(
            [f"{args.name}: unknown recipe; known: {', '.join(recipe_catalog.names())}"]
        ) from None
    return EXIT_OK


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="rljob", description="RL post-training jobs on TPU: render, check and explain RLJobs.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, fn, text in (
        ("render", cmd_render, "print every object of the job as a YAML stream"),
        ("validate", cmd_validate, "check a manifest"),
        ("plan", cmd_plan, "explain the resolved plan"),
    ):
        sp = sub.add_parser(name, help=text, description=text)
        sp.add_argument("-f", "--file", required=True, help="RLJob manifest (YAML), or - for stdin")
        sp.add_argument(
            "--pod-policy",
            metavar="FILE",
            help="the operator's pod policy (YAML: the chart's podPolicy values); default: the chart's",
        )
        sp.add_argument(
            "--jobset-restart-job",
            choices=("enabled", "disabled"),
            default="enabled",
            help="whether the cluster's JobSet admits the failure action RestartJob (its feature gate "
            "RestartJob; `rljob doctor` tells): disabled plans a sampler crash as a restart of the whole run "
            "(the operator's chart value jobset.restartJob); default: enabled",
        )
        if name == "plan":
            sp.add_argument("-o", "--output", choices=("text", "json"), default="text", help="text or json")
        sp.set_defaults(fn=fn)
    rp = sub.add_parser("recipes", help="the recipe catalog")
    rsub = rp.add_subparsers(dest="recipes_command", required=True, parser_class=_Parser)
    rsub.add_parser("list", help="list the recipes").set_defaults(fn=cmd_recipes_list)
    show = rsub.add_parser("show", help="print one recipe")
    show.add_argument("name")
    show.set_defaults(fn=cmd_recipes_show)
    from rljob.cli import doctor, drill, jobs  # light: their checks and clients load when they run

    doctor.register(sub)
    drill.register(sub)
    jobs.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    # pydantic looks for plugins in every installed distribution's entry points the first time a model
    # is built: ~15 ms of a ~200 ms `rljob render` in a venv with JAX. The CLI uses none; an explicit
    # setting in the environment still wins.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    from rljob.cli import drill

    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        code: int = args.fn(args)
    except _BadInput as e:
        for line in e.problems:
            print(line, file=sys.stderr)
        return EXIT_BAD_INPUT
    except drill.DrillBadInput as e:
        for line in e.problems:
            print(line, file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        return EXIT_OK
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from rljob.cli.jobs import JobError

        if not isinstance(e, JobError):
            print(f"rljob: internal error: {type(e).__name__}: {e}", file=sys.stderr)  # a bug: one line
            return EXIT_INTERNAL
        print(f"rljob: {e}", file=sys.stderr)
        return e.code
    return code


if __name__ == "__main__":
    raise SystemExit(main())
