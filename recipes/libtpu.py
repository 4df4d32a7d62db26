"""The trainer's libtpu flags (``spec.trainer.libtpuFlags``): what a TPU process reads from
``LIBTPU_INIT_ARGS`` when libtpu starts, XLA's TPU compiler flags among them.

The flags reach the TPU compiler three ways, all from the plan's one map: the trainer containers' env
(rljob.recipes.render), the compile preflight's pod, and the compile stage (``rljob drill --compile``,
rljob.trainer.compilecheck sets the env from the run config before libtpu loads). So the drill compiles what
the trainer compiles: a Pallas kernel that needs more scoped VMEM than libtpu's default (32 MiB on TPU7x)
compiles in both or in neither (``E1001 CompileTimeScopedVmemOom``).

The plan checks the form (a flag name, a value without whitespace: ``LIBTPU_INIT_ARGS`` is split on
whitespace) and what it can prove of a generation; a name libtpu does not know is found by libtpu itself (it
exits at start: ``Unknown command line flag``), which the compile stage reports naming the key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from rljob.recipes.syntax import key_path
from rljob.recipes.tpu import BY_ACCELERATOR

ENV: Final = "LIBTPU_INIT_ARGS"
FIELD: Final = "spec.trainer.libtpuFlags"
MAX_FLAGS: Final = 128
MAX_VALUE: Final = 1024
NAME: Final = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,127}$")
SCOPED_VMEM: Final = "xla_tpu_scoped_vmem_limit_kib"
UNKNOWN_FLAG: Final = re.compile(r"Unknown command line flag '([A-Za-z0-9_]+)'")
# What JAX appends to LIBTPU_INIT_ARGS on a machine with TPU chips, before libtpu starts, unless the flag
# is already there (jax/_src/cloud_tpu_init.py, ``cloud_tpu_init``; jax 0.12.0.1): a runtime flag, but JAX's
# persistent compilation cache hashes LIBTPU_INIT_ARGS into every key (jax/_src/cache_key.py,
# ``_hash_xla_flags``), and on a machine without chips JAX leaves the variable alone. The compile stage
# appends it too: measured on a TPU v5e, a program compiled here for v5e:1x1 then had the key the chip looked
# up (without it only the "XLA flags" part differed).
TPU_MACHINE_FLAG: Final = "xla_tpu_use_enhanced_launch_barrier"
XLA_FLAGS_ENV: Final = "XLA_FLAGS"
# XLA_FLAGS that change nothing, yet not empty: a dump option at XLA's default (XLA reads a value that does
# not start with "--" as a file name, and every XLA, jaxlib's and libtpu's, knows this flag). MaxText writes
# its HLO-dump defaults (``--xla_dump_to=... --xla_dump_large_constants``) into XLA_FLAGS whenever it builds
# a config and finds the variable empty (maxtext/configs/types.py, ``validate_and_set_hlo_dump_defaults``;
# MaxText 0.2.5). XLA reads the variable into its compile options once, at the first compile of the process,
# while JAX's cache key hashes the variable as it is at each compile (jax/_src/cache_key.py): a process that
# compiled anything before its first MaxText config (a trainer pod: its first collective) files its programs
# under other compile options than the compile stage (which builds the config first), with the same "XLA
# flags" part. Measured on a TPU v5e: the trainer's accumulate and apply programs had the compile stage's
# HLO, flags, platform and topology, and missed its cache on their compile options alone (docs/drill.md,
# "Starting without compiling"; tests/trainer/test_xla_flags_settled.py shows it with libtpu's compiler).
INERT_XLA_FLAGS: Final = "--xla_dump_large_constants=false"


def value_text(value: Any) -> str:
    """A flag's value as libtpu reads it: booleans lower case, numbers as written."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def resolve(flags: Mapping[str, Any] | None) -> dict[str, str]:
    """The flags as the plan holds them (name -> value text), sorted by name; a null value is no flag."""
    return {k: value_text(v) for k, v in sorted((flags or {}).items()) if v is not None}


def init_args(flags: Mapping[str, str]) -> str:
    """``LIBTPU_INIT_ARGS`` of the flags: ``--name=value`` separated by spaces ("" for none)."""
    return " ".join(f"--{k}={v}" for k, v in flags.items())


def tpu_machine_args(flags: Mapping[str, str]) -> str:
    """``LIBTPU_INIT_ARGS`` as a TPU machine's JAX leaves it for ``flags`` (the trainer containers' variable,
    :func:`init_args`): what a compile on a machine without chips must set so that JAX's cache keys match."""
    args = init_args(flags)
    if f"--{TPU_MACHINE_FLAG}" not in args:
        args += f" --{TPU_MACHINE_FLAG}=true"
    return args.strip()


def settled_xla_flags(env: Mapping[str, str], maxtext: Mapping[str, Any]) -> str | None:
    """The XLA_FLAGS a trainer process and the compile stage set before JAX compiles anything (None: leave it
    as it is), so that XLA's compile options and JAX's cache key see one value for the whole process, the same
    in both: :data:`INERT_XLA_FLAGS` where the variable is empty, which MaxText then leaves alone. A variable
    already set (a user's, a drill's) is kept, and so is MaxText's own where the keys ask it for HLO dumps
    (``dump_hlo``, ``dump_hlo_xla_flags``: MaxText refuses XLA_FLAGS beside the latter)."""
    if env.get(XLA_FLAGS_ENV) or maxtext.get("dump_hlo") or maxtext.get("dump_hlo_xla_flags"):
        return None
    return INERT_XLA_FLAGS


def problems(flags: Mapping[str, Any] | None, accelerator: str | None) -> list[str]:
    """Every problem of ``spec.trainer.libtpuFlags`` for a trainer on ``accelerator`` (the gke-tpu-accelerator
    label value, or None when the TPU is not known), one line each naming the key."""
    out: list[str] = []
    if not flags:
        return out
    if len(flags) > MAX_FLAGS:
        out.append(f"{FIELD}: {len(flags)} flags, at most {MAX_FLAGS}")
    for name, value in flags.items():
        where = key_path(FIELD, str(name))
        if not NAME.match(str(name)):
            out.append(
                f"{where}: not a libtpu flag name (letters, digits and underscores, no leading dashes: "
                f"the render writes --NAME=VALUE)"
            )
            continue
        if value is None:
            continue
        if not isinstance(value, str | int | float | bool):
            out.append(f"{where}: the value must be a string, number or boolean, got {type(value).__name__}")
            continue
        text = value_text(value)
        if not text or len(text) > MAX_VALUE or any(c.isspace() for c in text):
            out.append(
                f"{where}: the value must be 1 to {MAX_VALUE} characters without whitespace "
                f"({ENV} is split on whitespace), got {text[:40]!r}"
            )
    gen = BY_ACCELERATOR.get(accelerator) if accelerator else None
    vmem = flags.get(SCOPED_VMEM)
    if gen is not None and gen.max_scoped_vmem_kib is not None and vmem is not None:
        try:
            kib = int(value_text(vmem))
        except ValueError:
            out.append(f"{FIELD}.{SCOPED_VMEM}: an integer number of KiB, got {value_text(vmem)!r}")
        else:
            if not 0 < kib <= gen.max_scoped_vmem_kib:
                out.append(
                    f"{FIELD}.{SCOPED_VMEM}: {kib} KiB; a {gen.prefix} device's scoped VMEM is at most "
                    f"{gen.max_scoped_vmem_kib} KiB (libtpu refuses more per compile): use "
                    f"{gen.max_scoped_vmem_kib}"
                )
    return out


def unknown_flags(stderr: str) -> list[str]:
    """The flag names libtpu refused at start (``Unknown command line flag 'NAME'``) in a process's stderr."""
    return list(dict.fromkeys(UNKNOWN_FLAG.findall(stderr)))
