"""Untrusted input to an RLJob: a manifest's YAML text (`rljob validate/plan/render`) or an API body (the
admission webhook, the operator), bounded before it is parsed and checked with the CRD's own types.

Bounds, each refused with one `path: message` line, before any work that could grow faster than the input:
- YAML text: at most `MAX_TEXT_BYTES`; its event stream is scanned first (no Python objects are built) for
  nesting deeper than `MAX_DEPTH` and for more than `MAX_NODES` values once every alias is expanded (an
  "alias bomb" of a few hundred bytes expands to millions of values);
- any document (YAML or an API body): at most `MAX_NODES` values, `MAX_DEPTH` levels, strings of at most
  `MAX_STRING` characters and `MAX_JSON_BYTES` of JSON; only JSON values (YAML's !!binary, !!set, !!omap,
  unknown tags are refused), integers within int64 (the CRD's `format: int64`), finite floats;
- duplicate mapping keys are refused (PyYAML would keep the last one silently: a second `trainer:` block
  would drop the first without a word);
- YAML timestamps stay strings, as sigs.k8s.io/yaml (kubectl) decodes them.

Types are then checked as the API server checks them: the document is validated from its JSON with pydantic's
strict mode (an integer field refuses "8" and true, a string field refuses 8), so what `rljob validate`
accepts is what the CRD admits.

Every problem at once: the fields that fail to parse are set aside and the rest is planned (the plan's
check, which rljob.recipes.plan.parse_manifest and parse_object pass in: this module sits below the plan),
so a manifest with a bad queueName, an unknown MaxText key and a LoRA rank vLLM cannot serve shows all
three lines in one run. Plan problems about a field that was set aside are not
repeated; a bad spec.recipe stops there (everything else depends on it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any, Final

from pydantic import ValidationError
from rljob.recipes.api import RLJob
from rljob.recipes.problems import PlanError, pydantic_problems
from rljob.recipes.syntax import ROOT_FIELDS, key_path

MAX_TEXT_BYTES: Final = 256 * 1024
MAX_JSON_BYTES: Final = 256 * 1024
MAX_NODES: Final = 10_000
MAX_DEPTH: Final = 32
MAX_STRING: Final = 64 * 1024
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
# The name a manifest is planned under when its own metadata.name did not parse (its problems are dropped).
_PLACEHOLDER_NAME: Final = "rljob"
_MAX_ROUNDS: Final = 5


class _TooLarge(Exception):
    """A bound that stops the walk: the document is refused without looking further."""


class Refused:
    """A YAML value that is not a JSON value (or an integer out of range), kept where it was found so that
    the walk can name its path."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what


# ------------------------------------------------------------------------------------------ YAML


def _mark(node_or_event: Any) -> str:
    mark = getattr(node_or_event, "start_mark", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""


def _scan(text: str, loader: type) -> str | None:
    """A bound the event stream breaks (depth; values after alias expansion), else None."""
    import yaml

    total = 0
    anchors: dict[str, int] = {}
    open_: list[tuple[str | None, int]] = []
    for ev in yaml.parse(text, Loader=loader):
        if isinstance(ev, yaml.MappingStartEvent | yaml.SequenceStartEvent):
            total += 1
            open_.append((ev.anchor, total))
            if len(open_) > MAX_DEPTH:
                return f"(yaml): {_mark(ev)}nested deeper than {MAX_DEPTH} levels"
        elif isinstance(ev, yaml.MappingEndEvent | yaml.SequenceEndEvent):
            anchor, start = open_.pop()
            if anchor is not None:
                anchors[anchor] = total - start + 1
        elif isinstance(ev, yaml.ScalarEvent):
            total += 1
            if ev.anchor is not None:
                anchors[ev.anchor] = 1
        elif isinstance(ev, yaml.AliasEvent):
            total += anchors.get(ev.anchor or "", 1)
        if total > MAX_NODES:
            return f"(yaml): {_mark(ev)}more than {MAX_NODES} values (aliases expanded)"
    return None


def _loader() -> type:
    import yaml

    base: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class Loader(base):  # type: ignore[misc]
        """SafeLoader that refuses duplicate keys and non-JSON values (kept as Refused, with their line)."""

        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self.problems: list[str] = []

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: dict[tuple[str, str], int] = {}
                for key, _ in node.value:
                    if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                        continue
                    ident = (key.tag, key.value)
                    if ident in seen:
                        self.problems.append(
                            f"(yaml): {_mark(key)}duplicate key {key.value!r} (first on line {seen[ident]})"
                        )
                    else:
                        seen[ident] = key.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

        def construct_yaml_int(self, node: Any) -> Any:
            try:
                return super().construct_yaml_int(node)
            except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
                return Refused("an integer out of range (int64)")

        def construct_yaml_timestamp(self, node: Any) -> Any:
            return self.construct_scalar(node)  # a string, as kubectl's YAML decoder keeps it

        def construct_refused(self, node: Any) -> Any:
            return Refused(f"YAML tag {node.tag} (a manifest holds JSON values only)")

    for tag in ("binary", "set", "omap", "pairs"):
        Loader.add_constructor(f"tag:yaml.org,2002:{tag}", Loader.construct_refused)
    Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)
    Loader.add_constructor("tag:yaml.org,2002:timestamp", Loader.construct_yaml_timestamp)
    Loader.add_constructor(None, Loader.construct_refused)
    return Loader


_LOADER: type | None = None


def load_yaml(text: str) -> tuple[list[Any], list[str]]:
    """The documents of a YAML text and the problems found loading it (a syntax error, a bound broken:
    no documents; duplicate keys: the documents too, each problem a line)."""
    import yaml

    global _LOADER
    if _LOADER is None:
        _LOADER = _loader()
    size = len(text.encode("utf-8", errors="replace"))
    if size > MAX_TEXT_BYTES:
        return [], [f"(yaml): {size} bytes; a manifest is at most {MAX_TEXT_BYTES} bytes"]
    try:
        over = _scan(text, _LOADER)
        if over is not None:
            return [], [over]
        loader = _LOADER(text)
        try:
            docs = []
            while loader.check_data():
                docs.append(loader.get_data())
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        return [], [f"(yaml): {where}{problem}"]
    return [d for d in docs if d is not None], list(dict.fromkeys(loader.problems))


# ------------------------------------------------------------------------------------------ walk


class _Walk:
    """One pass over a document: JSON values only, within the bounds; what is refused is left out."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.dropped: list[str] = []
        self.nodes = 0
        self.size = 0

    def refuse(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}")
        self.dropped.append(path)

    def count(self, size: int) -> None:
        self.nodes += 1
        self.size += size
        if self.nodes > MAX_NODES:
            raise _TooLarge(f"(root): more than {MAX_NODES} values; an RLJob holds far fewer")
        if self.size > MAX_JSON_BYTES:
            raise _TooLarge(f"(root): more than {MAX_JSON_BYTES} bytes as JSON; an RLJob is far smaller")

    def string(self, value: str, path: str) -> str | Refused:
        if len(value) > MAX_STRING:
            return Refused(f"a string of {len(value)} characters (at most {MAX_STRING})")
        try:
            size = len(json.dumps(value, ensure_ascii=False).encode("utf-8"))
        except UnicodeEncodeError:
            return Refused("not valid Unicode text (a lone surrogate)")
        self.count(size)
        return value

    def value(self, value: Any, path: str, depth: int) -> Any:
        """The value as clean JSON data, or a Refused."""
        if depth > MAX_DEPTH:
            raise _TooLarge(f"{path}: nested deeper than {MAX_DEPTH} levels")
        if value is None or isinstance(value, bool):
            self.count(5)
            return value
        if isinstance(value, int):
            if not INT64_MIN <= value <= INT64_MAX:
                return Refused("an integer out of range (int64)")
            self.count(20)
            return value
        if isinstance(value, float):
            if not math.isfinite(value):
                return Refused(f"{value} is not a finite number")
            self.count(24)
            return value
        if isinstance(value, str):
            return self.string(value, path)
        if isinstance(value, Refused):
            return value
        if isinstance(value, list):
            self.count(2)
            out: list[Any] = []
            for i, item in enumerate(value):
                here = f"{path}[{i}]"
                clean = self.value(item, here, depth + 1)
                if isinstance(clean, Refused):
                    self.refuse(here, f"refused: {clean.what}")
                else:
                    out.append(clean)
            return out
        if isinstance(value, Mapping):
            self.count(2)
            obj: dict[str, Any] = {}
            for key, item in value.items():
                name = _json_key(key)
                if name is None:
                    self.refuse(path, f"refused: a key that is not a string ({type(key).__name__})")
                    continue
                at_root = path == "(root)" and name not in ROOT_FIELDS  # not an RLJob field: quoted
                here = key_path(path, name, quote=at_root)
                if name in obj:
                    self.refuse(here, "duplicate key")
                    continue
                checked = self.string(name, here)
                if isinstance(checked, Refused):
                    self.refuse(path, f"refused key: {checked.what}")
                    continue
                clean = self.value(item, here, depth + 1)
                if isinstance(clean, Refused):
                    self.refuse(here, f"refused: {clean.what}")
                else:
                    obj[name] = clean
            return obj
        return Refused(f"a {type(value).__name__}, not a JSON value")


def _json_key(key: Any) -> str | None:
    """A mapping key as JSON (and kubectl) writes it: strings as they are, scalars as their JSON text."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool | int) or (isinstance(key, float) and math.isfinite(key)):
        return json.dumps(key)
    return None


def clean(doc: Any) -> tuple[Any, list[str], list[str]]:
    """(the document as bounded JSON data, problems, paths left out). Raises PlanError when a bound that
    stops the walk is broken."""
    walk = _Walk()
    try:
        out = walk.value(doc, "(root)", 0)
    except _TooLarge as e:
        raise PlanError([str(e)]) from None
    if isinstance(out, Refused):
        raise PlanError([f"(root): refused: {out.what}"])
    return out, walk.problems, walk.dropped


# ------------------------------------------------------------------------------------------ parse


def _dig(doc: dict[str, Any], loc: tuple[Any, ...]) -> tuple[list[Any], Any]:
    """The longest prefix of a pydantic error location that exists in `doc`, and the value there."""
    node: Any = doc
    prefix: list[Any] = []
    for part in loc:
        in_dict = isinstance(node, dict) and isinstance(part, str) and part in node
        in_list = isinstance(node, list) and type(part) is int and 0 <= part < len(node)
        if not (in_dict or in_list):
            break
        node = node[part]
        prefix.append(part)
    return prefix, node


def _path(prefix: list[Any]) -> str:
    out = ""
    for part in prefix:
        out = f"{out}[{part}]" if type(part) is int else key_path(out, str(part))
    return out or "(root)"


def _remove(doc: dict[str, Any], prefix: list[Any]) -> None:
    parent: Any = doc
    for part in prefix[:-1]:
        parent = parent[part]
    parent.pop(prefix[-1])  # a dict's key or a list's index


def _set_aside(doc: dict[str, Any], err: ValidationError) -> list[str]:
    """Remove from `doc` every value an error points at (metadata.name becomes a placeholder): the paths
    removed, [] when nothing could be (the caller then stops)."""
    removed: list[str] = []
    for e in err.errors(include_url=False):
        loc = tuple(e["loc"])
        prefix, _ = _dig(doc, loc)
        if loc[:2] == ("metadata", "name") or loc == ("metadata",):
            meta = doc.get("metadata")
            doc["metadata"] = {**(meta if isinstance(meta, dict) else {}), "name": _PLACEHOLDER_NAME}
            removed.append("metadata.name")
        elif loc == ("spec",):
            doc["spec"] = {}
            removed.append("spec")
        elif prefix and prefix != ["spec"] and prefix != ["metadata"]:
            _remove(doc, prefix)
            removed.append(_path(prefix))
    return removed


def _validate(doc: dict[str, Any]) -> RLJob:
    # Strict, from JSON: what the API server's structural schema accepts (no "8" for an integer, no 8 for
    # a string; RFC 3339 strings for timestamps).
    return RLJob.model_validate_json(json.dumps(doc), strict=True)


def _under(line: str, paths: list[str]) -> bool:
    where = line.split(": ", 1)[0]
    return any(where == p or where.startswith((p + ".", p + "[")) for p in paths)


def parse_object(
    doc: Any, problems: list[str] | None = None, check: Callable[[RLJob], list[str]] | None = None
) -> RLJob:
    """An RLJob from a document (a manifest's data or an API body), or PlanError with every problem: the
    document's own (after `problems`, found before), and those ``check`` (the plan's, given by
    rljob.recipes.plan.parse_object: this module sits below the plan) finds in the rest of it (see the
    module docstring)."""
    problems = list(problems or [])
    if not isinstance(doc, Mapping):
        raise PlanError([*problems, f"(root): expected a mapping (an RLJob), got {type(doc).__name__}"])
    try:
        data, found, dropped = clean(doc)
    except PlanError as e:
        raise PlanError([*problems, *e.problems]) from None
    problems += found
    for _ in range(_MAX_ROUNDS):
        try:
            job = _validate(data)
        except ValidationError as err:
            problems += pydantic_problems(err)
            removed = _set_aside(data, err)
            if not removed:
                raise PlanError(list(dict.fromkeys(problems))) from None
            dropped += removed
            continue
        if not problems:
            return job
        break
    else:
        raise PlanError(list(dict.fromkeys(problems)))
    # The rest parses: plan it for the problems that do not depend on what was set aside.
    if check is not None and not any(p == "spec.recipe" or p.startswith("spec.recipe") for p in dropped):
        problems += [p for p in check(job) if not p.startswith("metadata.") and not _under(p, dropped)]
    raise PlanError(list(dict.fromkeys(problems)))


def parse_text(text: str, check: Callable[[RLJob], list[str]] | None = None) -> RLJob:
    """An RLJob from YAML text (one document), or PlanError with every problem (`parse_object`)."""
    docs, problems = load_yaml(text)
    if not docs and problems:
        raise PlanError(problems)
    if len(docs) != 1:
        raise PlanError([*problems, f"(yaml): expected one RLJob document, found {len(docs)}"])
    return parse_object(docs[0], problems, check)
