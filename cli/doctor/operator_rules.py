"""The operator's permissions: one table, with the reason for every verb and what breaks without it.

The chart's rules (charts/rljob/templates/_rules.tpl) and the table of docs/operator.md ("Permissions") are
generated from `OPERATOR_RULES` by hack/gen_rbac.py (`--check` in tests/chart/test_rbac_table.py), and
`rljob doctor` asks the API server, one SubjectAccessReview a verb, for exactly these
(`OPERATOR_PERMISSIONS`). A new child kind of a run (docs/architecture.md, "Where a change goes") is a new
row here, then `.venv/bin/python hack/gen_rbac.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rljob.cli.doctor.kueue import KUEUE_GROUP
from rljob.recipes.api import GROUP, PLURAL
from rljob.recipes.naming import JOBSET_GROUP


@dataclass(frozen=True)
class Rule:
    """One RBAC rule of the operator's Role (or ClusterRole): a resource of an API group and its verbs."""

    group: str
    resource: str  # "rljobs" or "rljobs/status"
    verbs: tuple[str, ...]
    why: str
    without: str  # what breaks when the verb is missing


@dataclass(frozen=True)
class Permission:
    """One verb of a rule: what doctor asks the API server about."""

    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespaced: bool = True

    def __str__(self) -> str:
        res = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        return f"{self.verb} {res}.{self.group}" if self.group else f"{self.verb} {res}"


OPERATOR_RULES: tuple[Rule, ...] = (
    Rule(
        GROUP, PLURAL, ("get", "list", "watch"),
        "the RLJobs are watched (kopf lists and watches them; the webhook reads none)",
        "the operator sees no RLJob: nothing is ever reconciled",
    ),
    Rule(
        GROUP, f"{PLURAL}/status", ("get", "patch"),
        "one server-side apply of `.status` a reconcile; the spec is never written",
        "no status: phase, conditions, progress and failures stay empty",
    ),
    Rule(
        GROUP, f"{PLURAL}/finalizers", ("update",),
        "the children's owner references set `blockOwnerDeletion`, which the API server allows only to "
        "whoever may update the owner's finalizers",
        "every child create is refused (403): no run starts",
    ),
    Rule(
        JOBSET_GROUP, "jobsets", ("get", "list", "watch", "create", "patch"),
        "each run's JobSet: created, watched for its state, read back after a 409 (get), `spec.suspend` "
        "merge-patched",
        "no run starts (create), its state never reaches the status (list, watch), suspend does nothing "
        "(patch)",
    ),
    Rule(
        KUEUE_GROUP, "workloads", ("list", "patch"),
        "a queued run's Kueue Workload: `spec.active` is how `spec.suspend` reaches Kueue "
        "(rljob.operator.kueue)",
        "suspending a queued run does not release its quota",
    ),
    Rule(
        "", "configmaps", ("get", "list", "watch", "create", "patch"),
        "the run ConfigMap and the progress ConfigMap: created, re-applied (patch) on a spec change or "
        "after a 409 (get); the progress one watched for the trainer's reports",
        "no run starts (create); progress never reaches the status (list, watch)",
    ),
    Rule(
        "batch", "jobs", ("get", "list", "watch", "create", "patch"),
        "server-side dry runs (`dryRun=All`) of the Jobs a JobSet will create, so that a refused Job shows "
        "in the status; the compile preflight's Job: created, watched, read back and applied after a 409. "
        "No update or delete (its TTL removes it)",
        "a Job the API server refuses shows only as a stuck JobSet; a run with "
        "`spec.trainer.preflight.compile` never starts",
    ),
    Rule(
        "", "pods", ("list", "watch"),
        "failed pods of a run tell preemption from maintenance from a crash (the JobSet controller creates "
        "pods; the operator never does)",
        "every failure counts as a crash against `spec.failurePolicy` and no failure message is shown",
    ),
    Rule(
        "", "serviceaccounts", ("get", "create", "patch"),
        "the run's own ServiceAccount (`<rljob>-rljob`, its pods' identity for Workload Identity): "
        "created, applied after a 409 (get, patch)",
        "no run starts",
    ),
    Rule(
        "rbac.authorization.k8s.io", "roles", ("get", "create", "patch"),
        "the Role of the run's pods: get and patch of the one progress ConfigMap (contract 4); "
        "Kubernetes' escalation check lets the operator grant only what it holds itself",
        "no run starts",
    ),
    Rule(
        "rbac.authorization.k8s.io", "rolebindings", ("get", "create", "patch"),
        "binds that Role to the run's ServiceAccount",
        "no run starts",
    ),
    Rule(
        "", "services", ("get", "create", "patch"),
        "the Service in front of the trainer of a run that serves an API (`spec.service`)",
        "a service-mode run does not start",
    ),
    Rule(
        "networking.k8s.io", "networkpolicies", ("get", "create", "patch"),
        "the run's NetworkPolicies (rljob.recipes.network), created before its JobSet",
        "no run starts (the policies come first, so a run never runs unguarded)",
    ),
    Rule(
        "", "secrets", ("get", "create"),
        "the run's credentials Secret (`<rljob>-credentials`): created once; read back only when the "
        "create answers 409, to check that its controller owner is the RLJob (a run interrupted half-way "
        "keeps its token; a Secret of that name that is not the run's is `ChildNotOwned`). No list, "
        "watch, patch or delete",
        "no run starts (create); a run interrupted between its Secret and its JobSet never resumes (get)",
    ),
    Rule(
        "events.k8s.io", "events", ("create",),
        "the operator's transition events (JobSet created, phase changes)",
        "no events (the status is unaffected)",
    ),
    Rule(
        "", "events", ("create", "list"),
        "kopf posts its warnings as core events (create); the Job controller's FailedCreate events of a "
        "run's Jobs, shown in the status (list)",
        "a pod the API server refuses shows only as a JobSet that does not progress",
    ),
)  # fmt: skip


def _permissions() -> tuple[Permission, ...]:
    out = []
    for rule in OPERATOR_RULES:
        resource, _, sub = rule.resource.partition("/")
        out += [Permission(verb, rule.group, resource, sub) for verb in rule.verbs]
    return tuple(out)


OPERATOR_PERMISSIONS: tuple[Permission, ...] = _permissions()
