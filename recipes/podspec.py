"""What every rendered TPU pod runs with: its security context, resources, /dev/shm and API token.

A pod meets the Kubernetes Pod Security Standards' `restricted` profile
(https://kubernetes.io/docs/concepts/security/pod-security-standards/) in all but one point: no
privilege escalation, every Linux capability dropped, not privileged, the runtime's default seccomp
profile, volumes of the types `restricted` allows (rljob's configMap and emptyDir; a pod template's are
limited by the operator's pod policy, rljob.recipes.podpolicy, whose default types are all among them), no
host namespaces (no hostNetwork, multi-slice included: rljob.recipes.render), no host ports. The exception,
named, because a TPU run needs it:

- The TPU containers run as root (`restricted` asks for runAsNonRoot). The images run as uid 0 because
  Google's own TPU manifests do and the TPU device nodes the device plugin hands a pod keep their owner on
  the node, which nothing documents (the Dockerfile and docs/gke.md, section 5, give the sources); a
  non-root uid could open them only where the container runtime maps them to the pod's runAsUser
  (containerd's `device_ownership_from_security_context`, https://github.com/containerd/containerd/pull/5122,
  for https://github.com/kubernetes/kubernetes/issues/92211). Root here is root without capabilities: it
  opens root-owned device nodes and writes its own $HOME, and can do nothing a capability would grant.

What is not needed, though others set it:
- `privileged: true` (xpk's TPU pods set it): GKE only required privileged TPU containers before GKE 1.28;
  since then the TPU device plugin hands a pod its TPU device nodes when it requests `google.com/tpu`.
- Capabilities: the runtime's default set (DAC_OVERRIDE, CHOWN, SETUID, NET_RAW, ...) holds nothing a TPU
  process uses; IPC_LOCK, which pinned-memory DMA can involve, is not in the default set either, so
  Google's unprivileged manifests run without it. Not verified on a TPU node: that libtpu and vLLM start
  with every capability dropped.

`/dev/shm` is a memory-backed emptyDir, as in xpk's and vLLM's Kubernetes manifests
(https://docs.vllm.ai/en/latest/deployment/k8s.html), bounded by `sizeLimit` (the kubelet sizes the tmpfs
to it and evicts a pod that writes more); the sampler's is larger (vLLM's and Ray's shared-memory queues and
object store live there). No `readOnlyRootFilesystem`: vLLM and JAX write small files under $HOME and /tmp
(the tokenizer, adapters, locks); `restricted` does not require it.

Resources: each TPU container requests its chips (limit = request, as the device plugin requires), and a
floor of CPU and memory so that the pod is never BestEffort (the first evicted and OOM-killed under node
memory pressure). No CPU or memory limits: a TPU pod has its TPU VM to itself (the chips of every host of
the slice are requested), a CPU limit would throttle the host-side input pipeline and a memory limit would
turn a host-memory peak (a checkpoint restore, vLLM loading weights) into an OOM kill, a counted restart.
Each TPU container also requests its share of `ephemeral-storage` for the caches (the sampler's model
download, the compilation caches), which live in rljob's emptyDir `rljob-cache` at the pods' cache path
rather than the container's writable layer, sized by the plan (rljob.recipes.disk) with the same size as
the emptyDir's `sizeLimit`; a template's own request wins (rljob.recipes.overrides.resources).

API access: only the trainer talks to the API server (it patches the `<rljob>-progress` ConfigMap,
contract 4); the sampler pods get no ServiceAccount token (`automountServiceAccountToken: false`).
"""

from __future__ import annotations

from typing import Any, Final

from rljob.recipes import naming

SHM_SIZE: Final = {naming.TRAINER: "8Gi", naming.SAMPLER: "32Gi"}
REQUESTS: Final = {"cpu": "1", "memory": "4Gi"}
"""Per TPU container, besides its chips: the floor that makes the pod Burstable (see the module docstring)."""

TERMINATION_MESSAGE_POLICY: Final = "FallbackToLogsOnError"
"""A container that fails without writing /dev/termination-log gets the end of its log as its termination
message: the `field: message` line an entrypoint prints before exit 2 reaches the pod's status, which the
operator copies into the RLJob's status.lastFailure."""


def pod_security_context() -> dict[str, Any]:
    """The pod's: the runtime's default seccomp profile. The user is the image's (root, see above)."""
    return {"seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }


def mounts_api_token(role: str) -> bool:
    """Whether a role's pods get a ServiceAccount token (the trainer reports progress; the sampler does not
    use the API)."""
    return role == naming.TRAINER


def resources(chips: int, tpu_resource: str, ephemeral_storage: str) -> dict[str, Any]:
    """One TPU container's: the floor, its share of the cache disk (the plan's CacheDisk.request) and its
    chips. No ephemeral-storage limit: the cache's emptyDir has its own sizeLimit."""
    return {
        "requests": {**REQUESTS, "ephemeral-storage": ephemeral_storage, tpu_resource: chips},
        "limits": {tpu_resource: chips},
    }
