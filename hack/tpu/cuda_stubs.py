"""Lets PyPI's CUDA build of torch import on a TPU machine that has none of NVIDIA's libraries.

vLLM's TPU engine (vllm-tpu with tpu-inference) runs its models in JAX but imports torch throughout, and the
only Linux torch the registries serve is the CUDA build: its shared objects name cudart, cuBLAS, cuDNN, NCCL,
... as NEEDED, so without them `import torch` fails even where no GPU will ever be used. Those libraries
weigh 4.4 GB; the TPU machine's calls carry 64 MiB. This writes, for every library a torch shared object
needs and the tree does not hold, a stub with the same SONAME and the symbol versions it is asked for, whose
every versioned function returns 100 (cudaErrorNoDevice / CUDA_ERROR_NO_DEVICE, which torch reads as "no
GPU"), and zeroes torch's `.nv_fatbin` sections (the GPU kernels, 0.9 GB of libtorch_cuda.so, read only by
the stubbed runtime), so that the bundle compresses to what a CPU build would weigh. Unversioned imports stay
unresolved: the dynamic linker binds functions lazily, and no CPU path calls them.

    python hack/tpu/cuda_stubs.py SITE_DIR      (run by hack/tpu/vllm_bundle.sh; needs gcc, readelf, objcopy)
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

# NVIDIA's libraries (what torch's CUDA build links): only these are stubbed; anything else missing is left
# for the import to report.
NVIDIA = re.compile(
    r"^lib(cuda|cudart|cublas|cublasLt|cudnn\w*|cufft|cufile|cupti|curand|cusolver|cusparse|cusparseLt|nccl|nvrtc|nvshmem_host|nvJitLink|nvToolsExt)\.so"
)
# The names NVIDIA's libraries export (an unversioned import outside these is Python's C API, libstdc++, ...).
NVIDIA_API = re.compile(r"^_*(cu|nccl|nvrtc|nvshmem|nvtx)")
NO_DEVICE = 100


def readelf(*args: str) -> str:
    return subprocess.run(["readelf", "-W", *args], check=True, capture_output=True, text=True).stdout


def needed(path: Path) -> list[str]:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf("-d", str(path)))


def version_needs(path: Path) -> dict[str, str]:
    """Version name -> the file that must define it, from the 'Version needs' section."""
    out: dict[str, str] = {}
    current = None
    in_needs = False
    for line in readelf("-V", str(path)).splitlines():
        if "Version needs section" in line:
            in_needs = True
            continue
        if not in_needs:
            continue
        if m := re.search(r"File: (\S+)", line):
            current = m.group(1)
        elif (m := re.search(r"Name: (\S+)", line)) and current:
            out[m.group(1)] = current
    return out


def dynamic_symbols(path: Path) -> tuple[list[tuple[str, str]], set[str]]:
    """(symbol, version or "") of each strong undefined dynamic symbol, and the names the object defines."""
    undefined, defined = [], set()
    for line in readelf("--dyn-syms", str(path)).splitlines():
        cols = line.split()
        if len(cols) < 8 or not cols[0].rstrip(":").isdigit():
            continue
        sym, _, version = cols[7].partition("@")
        if cols[6] != "UND":
            defined.add(sym)
        elif cols[4] == "GLOBAL" and sym:
            undefined.append((sym, version.lstrip("@")))
    return undefined, defined


def main(site: Path) -> int:
    objects = [
        p
        for p in site.rglob("*")
        if re.search(r"\.so(\.\d+)*$", p.name) and p.is_file() and not p.is_symlink()
    ]
    # A stub written by an earlier run (it defines rljob_cuda_stub) is rewritten, not taken for the library.
    present = {p.name for p in objects if "rljob_cuda_stub" not in readelf("--dyn-syms", str(p))}
    wants: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))  # lib -> version -> symbols
    dirs: dict[str, set[Path]] = defaultdict(set)
    symbols = {obj: dynamic_symbols(obj) for obj in objects}
    everywhere = set().union(*(defined for _, defined in symbols.values()))
    for obj in objects:
        try:
            libs = needed(obj)
        except subprocess.CalledProcessError:
            continue
        missing = [lib for lib in libs if lib not in present and NVIDIA.match(lib)]
        if not missing:
            continue
        owners = version_needs(obj)
        for lib in missing:
            dirs[lib].add(obj.parent)
            wants[lib]  # a library asked for with no versions still needs its SONAME
        for sym, version in symbols[obj][0]:
            if owners.get(version) in missing:
                wants[owners[version]][version].add(sym)
            elif not version and NVIDIA_API.match(sym) and sym not in everywhere:
                # Unversioned and defined nowhere in the tree: a function whose address is taken binds at
                # load time, not lazily; the first missing library's stub defines it (its default version).
                wants[missing[0]][""].add(sym)
    with tempfile.TemporaryDirectory() as tmp:
        for lib, versions in sorted(wants.items()):
            src = Path(tmp, "stub.c")
            script = Path(tmp, "stub.map")
            funcs = sorted({s for syms in versions.values() for s in syms})
            named = sorted(v for v in versions if v)
            src.write_text(
                "int rljob_cuda_stub(void) { return 0; }\n"
                + "".join(f"int {s}(void) {{ return {NO_DEVICE}; }}\n" for s in funcs)
                + "".join(
                    f"int rljob_stub_{i}(void) {{ return {NO_DEVICE}; }}\n" for i, _ in enumerate(named)
                )
            )
            nodes = []
            for i, version in enumerate(named):
                syms = (
                    versions[version]
                    | {f"rljob_stub_{i}"}
                    | ({"rljob_cuda_stub"} | versions.get("", set()) if i == 0 else set())
                )
                nodes.append(f"{version} {{ global: {' '.join(f'{s};' for s in sorted(syms))} }};")
            script.write_text("\n".join(nodes) + "\n" if nodes else "{ global: *; };\n")
            for where in sorted(dirs[lib]):
                out = where / lib
                subprocess.run(
                    [
                        "gcc",
                        "-shared",
                        "-fPIC",
                        "-O0",
                        "-w",
                        f"-Wl,-soname,{lib}",
                        f"-Wl,--version-script={script}",
                        "-o",
                        str(out),
                        str(src),
                    ],
                    check=True,
                )
            print(f"stub {lib}: {len(versions)} versions, {len(funcs)} functions", file=sys.stderr)
    for obj in objects:
        sections = readelf("-S", str(obj))
        m = re.search(r"\]\s+\.nv_fatbin\s+\S+\s+[0-9a-f]+\s+[0-9a-f]+\s+([0-9a-f]+)", sections)
        if m and int(m.group(1), 16) > 0:
            size = int(m.group(1), 16)
            zeros = Path(tempfile.mkstemp()[1])
            with zeros.open("wb") as f:
                f.truncate(size)
            subprocess.run(["objcopy", f"--update-section=.nv_fatbin={zeros}", str(obj)], check=True)
            zeros.unlink()
            print(f"zeroed .nv_fatbin of {obj.relative_to(site)}: {size / 2**20:.0f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
