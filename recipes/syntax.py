"""The syntax of every string an RLJob passes on: Kubernetes names and label values, container images,
Hugging Face model ids, catalog names.

Each pattern is used twice: as a pydantic `pattern` in rljob.recipes.api (so `rljob validate`, the
admission webhook and the CRD that hack/gen_crd.py generates from the same fields all refuse the same
values) and, where a value reaches a file name or a command line, by the code that uses it. The patterns
are written in the common subset of the regex dialects involved: Rust's regex crate (pydantic-core) and
Go's RE2 (the API server's OpenAPI `pattern`): no look-around, no back-references, ASCII classes only
(Rust's `\\w` is Unicode-aware, RE2's is not).
"""

from __future__ import annotations

import json
import re
from typing import Final

_ALNUM = "[a-z0-9]"
_LABEL_BODY = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"

DNS1123_LABEL: Final = f"^{_LABEL_BODY}$"
"""A DNS-1123 label (Namespace, most object names): lowercase letters, digits and '-', at most 63."""
DNS1123_LABEL_MAX: Final = 63

DNS1123_SUBDOMAIN: Final = f"^{_LABEL_BODY}(\\.{_LABEL_BODY})*$"
"""A DNS-1123 subdomain (PriorityClass, ConfigMap names...): dot-separated labels, at most 253."""
DNS1123_SUBDOMAIN_MAX: Final = 253

QUEUE_NAME: Final = f"^{_ALNUM}([-a-z0-9.]*{_ALNUM})?$"
"""A Kueue LocalQueue name as it must be to serve as the value of the label kueue.x-k8s.io/queue-name: an
object name (DNS-1123 subdomain characters) that is also a valid label value (at most 63 characters)."""
QUEUE_NAME_MAX: Final = 63

LABEL_VALUE: Final = "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
"""Any Kubernetes label value (apimachinery's IsValidLabelValue), at most 63 characters."""
LABEL_VALUE_MAX: Final = 63

# A container image reference, the grammar of github.com/distribution/reference (reference.go):
# [domain[:port]/]path[:tag][@digest], path components lowercase. An empty or spaced image is accepted by
# the JobSet API and only refused when its Job creates pods.
_DOMAIN_COMPONENT = "[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?"
_DOMAIN = f"{_DOMAIN_COMPONENT}(\\.{_DOMAIN_COMPONENT})*(:[0-9]+)?"
_PATH_COMPONENT = "[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*"
_TAG = "[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = "[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE: Final = f"^({_DOMAIN}/)?{_PATH_COMPONENT}(/{_PATH_COMPONENT})*(:{_TAG})?(@{_DIGEST})?$"
IMAGE_MAX: Final = 512

_HF_PART = "[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?"
HF_MODEL_ID: Final = f"^({_HF_PART}/)?{_HF_PART}$"
"""A Hugging Face model id, `org/name` or `name`: starts with a letter or digit (so it never parses as a
command-line flag of `vllm serve`), no path separators beyond the one, no `..` component."""
HF_MODEL_ID_MAX: Final = 128

HF_REVISION: Final = "^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$"
"""A Hugging Face revision: a branch, a tag or a commit hash, without '/' (it becomes one component of
the converted checkpoint's storage path) and never a command-line flag."""
HF_REVISION_MAX: Final = 100

HF_COMMIT: Final = "^[0-9a-f]{40}$"
"""A full Hugging Face commit hash (40 lowercase hexadecimal digits): the one revision that never moves."""

CATALOG_NAME: Final = QUEUE_NAME
"""A recipe or profile name: lowercase letters, digits, '-' and '.'; never a path."""
CATALOG_NAME_MAX: Final = 63

VERSION: Final = "^[0-9]+(\\.[0-9A-Za-z]+)*$"
"""A version such as 0.2.5 or 0.2.5.post1: never a path."""
VERSION_MAX: Final = 32

MODULE_NAME: Final = "^[A-Za-z_][A-Za-z0-9_]*$"
"""A model module name (LoRA target), e.g. q_proj."""
MODULE_NAME_MAX: Final = 64

MAXTEXT_MODEL: Final = "^[a-z0-9][a-z0-9._-]*$"
MAXTEXT_MODEL_MAX: Final = 128

UID: Final = "^[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?$"
"""metadata.uid as the API server writes it (a UUID); it becomes a storage path component."""
UID_MAX: Final = 63

PATH_MAX: Final = 1024
"""gs:// paths and absolute file paths."""

# What each pattern means, for the problem line that refuses a value (pydantic would print the regex).
DESCRIPTIONS: Final = {
    DNS1123_LABEL: "must be a DNS-1123 label: lowercase letters, digits and '-', starting and ending with "
    "a letter or digit",
    DNS1123_SUBDOMAIN: "must be a DNS-1123 subdomain: lowercase letters, digits, '-' and '.', each "
    "dot-separated part starting and ending with a letter or digit",
    LABEL_VALUE: "must be a label value: letters, digits, '-', '_' and '.', starting and ending with a "
    "letter or digit",
    IMAGE: "must be a container image reference, [registry[:port]/]path[:tag][@digest], path in lowercase, "
    "without spaces",
    HF_MODEL_ID: "must be a Hugging Face model id, org/name or name (letters, digits, '.', '_', '-'; "
    "starting and ending with a letter or digit)",
    HF_REVISION: "must be a Hugging Face revision: a branch, a tag or a commit hash (letters, digits, '.', "
    "'_', '-'; starting and ending with a letter or digit)",
    HF_COMMIT: "must be a full Hugging Face commit hash (40 lowercase hexadecimal digits)",
    # QUEUE_NAME is the same pattern (a name that is also a label value).
    CATALOG_NAME: "must hold only lowercase letters, digits, '-' and '.', and start and end with a letter "
    "or digit",
    VERSION: "must be a version such as 0.2.5",
    MODULE_NAME: "must be a module name such as q_proj",
    MAXTEXT_MODEL: "must be a MaxText model name such as qwen3-8b",
    UID: "must be an object uid as the API server writes it",
}

_COMPILED: dict[str, re.Pattern[str]] = {}


def matches(pattern: str, value: str) -> bool:
    """Whether `value` matches one of the patterns above (compiled once)."""
    rx = _COMPILED.get(pattern)
    if rx is None:
        rx = _COMPILED[pattern] = re.compile(pattern)
    return rx.fullmatch(value) is not None  # fullmatch: Python's `$` also matches before a final \n


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")
ROOT_FIELDS: Final = frozenset({"apiVersion", "kind", "metadata", "spec", "status"})
"""An RLJob's own top-level fields: any other key at a manifest's root is quoted, `(root)["foo"]`."""


def key_path(base: str, key: str, *, quote: bool = False) -> str:
    """`base.key` for a plain key, `base["odd key"]` (JSON-quoted) otherwise, so that a problem line stays
    `path: message` whatever the key holds. A base of "" or "(root)" is the document's root. All-digit keys
    are quoted too (`x.1` would read as an index)."""
    plain = not quote and _PLAIN_KEY.fullmatch(key) is not None and not key.isdigit()
    if base in ("", "(root)"):
        return key if plain else f"(root)[{json.dumps(key)}]"
    return f"{base}.{key}" if plain else f"{base}[{json.dumps(key)}]"
