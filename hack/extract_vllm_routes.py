"""Extract the HTTP routes the pinned vLLM can register from its source, into tests/sampler/data/.

    python -P hack/extract_vllm_routes.py VLLM_SOURCE_DIR VERSION

VLLM_SOURCE_DIR is an unpacked vLLM source tree (e.g. `pip download vllm-tpu==0.32.0 --no-deps` gives
vllm_tpu-0.32.0.tar.gz; unpack it). Every call `<x>.get|post|put|delete|patch|api_route|websocket|
add_api_route|add_api_websocket_route("/path", ...)`, `Mount("/path", ...)` and `<app>.mount("/path", ...)`
under vllm/entrypoints is a route some configuration registers (a superset of what one server serves: a
route behind a flag counts), and EXTERNAL lists the routes a package vLLM calls registers (not in vLLM's
source). The test of the sampler's
authenticating front (tests/sampler/test_front.py) asks each of them through the front.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

METHODS = {
    "get": ["GET"],
    "post": ["POST"],
    "put": ["PUT"],
    "delete": ["DELETE"],
    "patch": ["PATCH"],
    "api_route": ["GET", "POST"],
    "add_api_route": ["GET", "POST"],
    "websocket": ["GET"],
    "add_api_websocket_route": ["GET"],
}


EXTERNAL = [
    # vllm/entrypoints/serve/lora/api_router.py decorates its handlers with model_hosting_container_standards'
    # sagemaker register_load_adapter_handler / register_unload_adapter_handler (body {name, src,
    # load_inplace}; path parameter adapter_name), registered with VLLM_ALLOW_RUNTIME_LORA_UPDATING.
    ("POST", "/adapters", "model_hosting_container_standards.sagemaker (register_load_adapter_handler)"),
    ("DELETE", "/adapters/{adapter_name}", "model_hosting_container_standards.sagemaker (unload handler)"),
]


def _methods(call: ast.Call, attr: str) -> list[str]:
    for kw in call.keywords:
        if kw.arg == "methods" and isinstance(kw.value, (ast.List, ast.Tuple, ast.Set)):
            got = [
                e.value.upper()
                for e in kw.value.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            ]
            if got:
                return got
    return METHODS[attr]


def routes(root: Path) -> list[dict[str, str]]:
    out: set[tuple[str, str, str]] = set()
    base = root / "vllm" / "entrypoints"
    for path in sorted(base.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            attr = node.func.attr
            if attr not in METHODS or not node.args:
                continue
            first = node.args[0]
            if (
                isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and first.value.startswith("/")
            ):
                for method in _methods(node, attr):
                    out.add((method, first.value, str(path.relative_to(root))))
        for node in ast.walk(tree):
            # Mount("/metrics", app) and app.mount("/static", ...): every method of everything below
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            first = node.args[0]
            if (
                name in ("Mount", "mount")
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and first.value.startswith("/")
            ):
                for method in ("GET", "POST"):
                    out.add((method, first.value, str(path.relative_to(root))))
    out.update(EXTERNAL)
    return [
        {"method": m, "path": p, "source": s} for m, p, s in sorted(out, key=lambda r: (r[1], r[0], r[2]))
    ]


def main() -> None:
    root, version = Path(sys.argv[1]), sys.argv[2]
    table = {
        "vllm": version,
        "regenerate": f"python -P hack/extract_vllm_routes.py <vllm_tpu-{version} source> {version}",
        "routes": routes(root),
    }
    out = Path(__file__).resolve().parents[1] / "tests" / "sampler" / "data" / f"vllm-{version}-routes.json"
    out.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    print(f"{out}: {len(table['routes'])} routes")


if __name__ == "__main__":
    main()
