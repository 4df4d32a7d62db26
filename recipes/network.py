"""The NetworkPolicies of a run: who may open a connection to its pods.

A run's pods listen on ports that must not be reachable from the rest of the cluster: the JAX coordinator
(trainer process 0, `COORDINATOR_PORT`), the samplers' OpenAI-compatible API (`SAMPLER_PORT`, which loads
LoRA adapters at run time) and their adapter agent (`SAMPLER_PORT + ADAPTER_AGENT_PORT_OFFSET`), the Ray
head and workers of a multi-host sampler replica (`RAY_PORT` and Ray's worker ports) and, in service mode,
the trainer's API port. Two policies cover them:

- `<rljob>-pods` selects every pod of the run (label `rljob.dev/rljob`) and admits ingress only from pods
  with the same label in the same namespace, on any port: the run talks to itself (trainer to samplers,
  samplers among a Ray replica, trainer processes to the coordinator) and nobody else reaches it.
- `<rljob>-api-clients` (service mode only) selects the trainer's pods and admits ingress to the API port
  from every pod of the run's own namespace and of the namespaces in `spec.service.clientNamespaces`.

NetworkPolicies are additive: a connection is admitted when one policy selecting the pod admits it.

Egress (`<rljob>-pods`, so every pod of the run, the compile preflight's included) is open but for the
node's metadata server: any pod of the cluster on any port (the run's peers, cluster DNS; Cilium, which
runs GKE Dataplane V2, matches no pod with an ipBlock), any address outside the cluster on any port (GCS,
the API server, a multi-slice trainer's other slices) except `METADATA_ADDRESSES`, and of those only
`WORKLOAD_IDENTITY_PORTS`: the GKE metadata server's ports that Workload Identity Federation for GKE needs
allowed where a NetworkPolicy restricts egress
(https://cloud.google.com/kubernetes-engine/docs/how-to/network-policy, "Limitations and requirements":
169.254.169.252/32 port 988, and 169.254.169.254/32 port 80 on Dataplane V2, which checks the address a
pod dials before the node redirects it). A node without the GKE metadata server answers 169.254.169.254:80
with the Compute Engine metadata server itself; no NetworkPolicy can tell the two apart (docs/operator.md,
"Network").

A NetworkPolicy takes effect only where the cluster's network plugin enforces them (GKE: Dataplane V2, or
network policy enforcement turned on); docs/operator.md says how to check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rljob.recipes import naming

if TYPE_CHECKING:
    from rljob.recipes.runconfig import RunConfig

API_VERSION = "networking.k8s.io/v1"
RUN_LABEL = naming.RUN_LABEL
ROLE_LABEL = naming.ROLE_LABEL
# The label the API server sets on every Namespace (since Kubernetes 1.22): its name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
# The node's metadata server: the Compute Engine address, the GKE metadata server's own (where GKE redirects
# 169.254.169.254:80 on nodes with Workload Identity), and the IPv6 one
# (https://cloud.google.com/compute/docs/metadata/querying-metadata).
METADATA_ADDRESSES = ("169.254.169.254/32", "169.254.169.252/32", "fd20:ce::254/128")
# What of them stays open: Workload Identity's path (see the module docstring).
WORKLOAD_IDENTITY_PORTS = (("169.254.169.254/32", 80), ("169.254.169.252/32", 988))


def egress_rules() -> list[dict[str, Any]]:
    """The egress of every pod of a run (see the module docstring)."""
    v4 = [a for a in METADATA_ADDRESSES if ":" not in a]
    v6 = [a for a in METADATA_ADDRESSES if ":" in a]
    return [
        {"to": [{"namespaceSelector": {}}]},
        {
            "to": [
                {"ipBlock": {"cidr": "0.0.0.0/0", "except": v4}},
                {"ipBlock": {"cidr": "::/0", "except": v6}},
            ]
        },
        *(
            {"to": [{"ipBlock": {"cidr": cidr}}], "ports": [{"port": port, "protocol": "TCP"}]}
            for cidr, port in WORKLOAD_IDENTITY_PORTS
        ),
    ]


def policies(
    run: RunConfig, metadata: dict[str, Any], api_metadata: dict[str, Any], api_port: str
) -> list[dict[str, Any]]:
    """The run's NetworkPolicies (see the module docstring). ``metadata`` / ``api_metadata``: the two
    objects' metadata as the render builds it (names from naming.network_policy / api_network_policy);
    ``api_port``: the trainer container's named API port."""

    def run_pods() -> dict[str, Any]:  # a fresh dict each use: the YAML of `rljob render` has no aliases
        return {"matchLabels": {RUN_LABEL: run.name}}

    out: list[dict[str, Any]] = [
        {
            "apiVersion": API_VERSION,
            "kind": "NetworkPolicy",
            "metadata": metadata,
            "spec": {
                "podSelector": run_pods(),
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [{"from": [{"podSelector": run_pods()}]}],
                "egress": egress_rules(),
            },
        }
    ]
    svc = run.spec.service
    if svc is not None:
        namespaces = sorted({run.namespace, *svc.client_namespaces})
        out.append(
            {
                "apiVersion": API_VERSION,
                "kind": "NetworkPolicy",
                "metadata": api_metadata,
                "spec": {
                    "podSelector": {"matchLabels": {RUN_LABEL: run.name, ROLE_LABEL: naming.TRAINER}},
                    "policyTypes": ["Ingress"],
                    "ingress": [
                        {
                            "from": [
                                {
                                    "namespaceSelector": {
                                        "matchExpressions": [
                                            {
                                                "key": NAMESPACE_NAME_LABEL,
                                                "operator": "In",
                                                "values": namespaces,
                                            }
                                        ]
                                    }
                                }
                            ],
                            "ports": [{"port": api_port, "protocol": "TCP"}],
                        }
                    ],
                },
            }
        )
    return out
