"""The demo and the serving benchmarks serve in the dtype this CPU runs
fast (tools/bench/cpu_dtype.py): bfloat16 with AVX-512 BF16 or AMX, float32
otherwise, an override winning; the engines they start are told so."""

from __future__ import annotations

from pathlib import Path

import pytest

from ucm_db.tools.bench import cpu_dtype
from ucm_db.tools.bench.cpu_dtype import fast_dtype
from ucm_db.tools.bench.serve_server import ServerSpec


def test_bfloat16_only_where_the_cpu_has_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_dtype.OVERRIDE_ENV, raising=False)
    assert fast_dtype(flags=frozenset({"avx2", "avx512f", "avx512_bf16"})).dtype == "bfloat16"
    assert fast_dtype(flags=frozenset({"avx2", "amx_bf16", "amx_tile"})).dtype == "bfloat16"
    avx2 = fast_dtype(flags=frozenset({"avx2", "avx512f"}))  # AVX-512 without BF16: emulated
    assert avx2.dtype == "float32" and "override" in avx2.reason


def test_an_override_wins_and_a_bad_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_dtype.OVERRIDE_ENV, "bfloat16")
    assert fast_dtype(flags=frozenset()).dtype == "bfloat16"
    assert fast_dtype("float32", flags=frozenset({"amx_bf16"})).dtype == "float32"
    with pytest.raises(ValueError, match="bfloat16, float32"):
        fast_dtype("int8")


def test_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_dtype.cpu_flags(info) == frozenset({"fpu", "sse", "avx2", "amx_bf16"})
    assert cpu_dtype.cpu_flags(tmp_path / "absent") == frozenset()


def test_the_serving_benchmark_starts_its_servers_in_the_chosen_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_dtype.OVERRIDE_ENV, "float32")
    argv = ServerSpec(Path("/m"), None, 2048).argv(8100)
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert ServerSpec(Path("/m"), None, 2048, dtype="bfloat16").argv(8100).count("bfloat16") == 1
