"""Values of an RLJob that the API server or Cloud Storage would refuse later, refused at validate: the API
Service's port against the run's own ports, Kueue queue names, bucket names, object-name lengths.

- `spec.service.port`: the trainer pod's container ports (the JAX coordinator's, libtpu's process ports)
  and the samplers' (vLLM's, the adapter agent's, Ray's head): one number, one meaning inside a run, so a
  port is never served twice nor mistaken for another by a NetworkPolicy or a probe.
- `spec.queueName`: the value of the label kueue.x-k8s.io/queue-name, so a LocalQueue's name: a DNS-1123
  subdomain (the object name) of at most 63 characters (the label value); `a..b` is a label value but can
  name no LocalQueue.
- `spec.storage.root`'s bucket: Cloud Storage's naming rules
  (https://cloud.google.com/storage/docs/buckets#naming): 3-63 characters of lowercase letters, digits,
  '-', '_' and '.', starting and ending with a letter or digit; dot-separated components non-empty; not an
  IP address in dotted-decimal notation; not starting with "goog"; not containing "google" or a close
  misspelling ("g00gle").
- object names: Cloud Storage's longest is 1,024 bytes of UTF-8
  (https://cloud.google.com/storage/docs/objects#naming). The run writes under
  `{prefix}/{namespace}/{name}/{uid}/` (StoragePaths, rljob.recipes.runconfig); what it writes below that
  stays within RUN_SUFFIX_MAX bytes, a budget with room to spare over the longest names it makes: orbax's
  checkpoint files (`checkpoints/{step}/{item}/ocdbt.process_{i}/d/{32 hex}`, under 100 bytes) and the
  Tinker service's checkpoints (a model id, a kind and a name of at most 128 characters, rljob.trainer.tinker,
  with orbax's files inside: under 300 bytes).
"""

from __future__ import annotations

import re
from typing import Final

from rljob.recipes import syntax
from rljob.recipes.runconfig import ADAPTER_AGENT_PORT_OFFSET, COORDINATOR_PORT, RAY_PORT, SAMPLER_PORT
from rljob.recipes.topology import MAX_CONTAINERS_PER_HOST, TPU_PROCESS_PORT_BASE

RUN_PORTS: Final = {
    COORDINATOR_PORT: "the JAX coordinator's (trainer)",
    SAMPLER_PORT: "vLLM's (sampler)",
    SAMPLER_PORT + ADAPTER_AGENT_PORT_OFFSET: "the adapter agent's (sampler)",
    RAY_PORT: "the Ray head's (multi-host sampler)",
    **{
        TPU_PROCESS_PORT_BASE + i: f"libtpu's process port of TPU container {i}"
        for i in range(MAX_CONTAINERS_PER_HOST)
    },
}
"""Every port a run's pods listen on besides the API's."""

OBJECT_NAME_MAX: Final = 1024
UID_LEN: Final = 36
"""metadata.uid as the API server writes it (a UUID): its length where `rljob validate` has none yet."""
RUN_SUFFIX_MAX: Final = 320
"""The longest object name the run writes below its own folder `{...}/{uid}/` (see the module docstring)."""

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
_IPV4 = re.compile(r"^[0-9]{1,3}(\.[0-9]{1,3}){3}$")
_GOOGLE = re.compile(r"g[o0]{2}g[l1]e")


def service_port(port: int | None) -> list[str]:
    if port is not None and port in RUN_PORTS:
        return [
            f"spec.service.port: {port} is {RUN_PORTS[port]} port in every run; choose another "
            f"(not {', '.join(str(p) for p in sorted(RUN_PORTS))})"
        ]
    return []


def queue_name(name: str | None) -> list[str]:
    if name is None:
        return []
    if len(name) > syntax.QUEUE_NAME_MAX or not syntax.matches(syntax.DNS1123_SUBDOMAIN, name):
        return [
            f"spec.queueName: {name!r} can name no Kueue LocalQueue: "
            f"{syntax.DESCRIPTIONS[syntax.DNS1123_SUBDOMAIN]}, at most {syntax.QUEUE_NAME_MAX}"
        ]
    return []


def bucket(name: str) -> str | None:
    """Why Cloud Storage refuses `name` as a bucket name, or None."""
    if not _BUCKET.match(name):
        return "3-63 lowercase letters, digits, '-', '_' and '.', starting and ending with a letter or digit"
    if "" in name.split(".") or any(
        not part[0].isalnum() or not part[-1].isalnum() for part in name.split(".")
    ):
        return "each dot-separated part must start and end with a letter or digit"
    if _IPV4.match(name):
        return "may not be an IP address"
    if name.startswith("goog"):
        return 'may not start with "goog"'
    if _GOOGLE.search(name):
        return 'may not contain "google" or a close misspelling of it'
    return None


def storage_root(root: str | None, namespace: str, name: str, uid: str | None) -> list[str]:
    """The bucket of a gs:// root and the length of the object names the run writes under it."""
    if root is None or not root.startswith("gs://"):
        return []
    bucket_name, _, prefix = root[len("gs://") :].partition("/")
    out = []
    if why := bucket(bucket_name):
        out.append(f"spec.storage.root: bucket {bucket_name!r}: {why} (Cloud Storage's bucket naming rules)")
    parts = [p for p in (prefix.rstrip("/"), namespace, name, uid or "u" * UID_LEN) if p]
    longest = len("/".join(parts).encode()) + 1 + RUN_SUFFIX_MAX
    if longest > OBJECT_NAME_MAX:
        room = OBJECT_NAME_MAX - (longest - len(prefix.rstrip("/").encode()))
        out.append(
            f"spec.storage.root: the run's object names would reach {longest} bytes, over Cloud Storage's "
            f"{OBJECT_NAME_MAX}: shorten the prefix after the bucket to at most {max(room, 0)} bytes"
        )
    return out
