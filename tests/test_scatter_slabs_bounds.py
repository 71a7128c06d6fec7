"""ScatterSlabs refuses what its native calls cannot take, with a
ConfigError naming the argument, and the native gather never divides by a
row size that overflowed: ``ScatterSlabs([bytearray(64)] * 4, [2**62] * 4,
[]).gather_into(out)`` summed the slab sizes to 0 in C and killed the
process with SIGFPE (the constructor let sizes past their views through
when no index was given). A read into more slab views than the native
batch load takes (1024) raised a bare ValueError for two keys or more."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ucm_db
from ucm_db import ConfigError, ScatterSlabs
from ucm_db.codec import native

ROOT = Path(__file__).resolve().parent.parent
NS = ucm_db.Namespace(model="scatter-slabs-bounds", kv_dtype="bfloat16", block_size=4)


def test_sizes_summing_past_2_63_never_crash_the_process() -> None:
    """In a child: before the fix it died of SIGFPE (returncode -8)."""
    code = textwrap.dedent("""
        import ucm_db
        try:
            ucm_db.ScatterSlabs([bytearray(64) for _ in range(4)], [2**62] * 4, []).gather_into(bytearray(64))
            print("gathered")
        except ucm_db.ConfigError as exc:
            print("ConfigError", exc)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("ConfigError"), done.stdout


@pytest.mark.parametrize("sizes", [[2**62] * 4, [65], [64, 64, 128]])
def test_a_slab_larger_than_its_view_is_refused_even_without_indices(sizes: list[int]) -> None:
    with pytest.raises(ConfigError, match="larger than the view"):
        ScatterSlabs([bytearray(64) for _ in sizes], sizes, [])


@pytest.mark.skipif(native.extension() is None, reason="the C extension is not built")
def test_the_native_gather_checks_the_row_size_itself() -> None:
    """Called directly (past the constructor's check), in a child: a
    ValueError, no SIGFPE."""
    code = textwrap.dedent("""
        from ucm_db.codec import native
        ext = native.extension()
        for sizes in ((2**62,) * 4, (64, 2**62)):
            try:
                ext.gather_slabs(tuple(bytearray(64) for _ in sizes), sizes, [], bytearray(64))
                print("gathered")
            except ValueError as exc:
                print("ValueError", exc)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert [line.split()[0] for line in done.stdout.splitlines()] == ["ValueError", "ValueError"], done.stdout
    assert "over the view" in done.stdout


BAD_ARGUMENTS = {
    "indices None": (lambda: ScatterSlabs([bytearray(64)], [64], None), "indices"),  # type: ignore[arg-type]
    "indices a str": (lambda: ScatterSlabs([bytearray(64)], [64], "0"), "indices"),
    "an index a str": (lambda: ScatterSlabs([bytearray(64)], [64], ["0"]), "indices"),
    "an index a float": (lambda: ScatterSlabs([bytearray(64)], [64], [0.0]), "indices"),  # type: ignore[list-item]
    "views a generator": (lambda: ScatterSlabs((v for v in [bytearray(64)]), [64], [0]), "views"),  # type: ignore[arg-type]
    "views one buffer": (lambda: ScatterSlabs(bytearray(64), [64], [0]), "views"),
    "a size a str": (lambda: ScatterSlabs([bytearray(64)], ["64"], [0]), "slab_bytes"),  # type: ignore[list-item]
    "slab_bytes an int": (lambda: ScatterSlabs([bytearray(64)], 64, [0]), "slab_bytes"),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("name", sorted(BAD_ARGUMENTS))
def test_arguments_of_the_wrong_kind_are_a_config_error_naming_them(name: str) -> None:
    make, argument = BAD_ARGUMENTS[name]
    with pytest.raises(ConfigError, match=argument) as raised:
        make()
    assert raised.value.hint


def test_integer_like_indices_and_sizes_still_work() -> None:
    import numpy as np

    views = [bytearray(256), bytearray(128)]
    slabs = ScatterSlabs(views, np.array([64, 32]), np.arange(3))
    assert slabs.indices == [0, 1, 2] and slabs.slab_bytes == (64, 32)
    assert ScatterSlabs(views, [64, 32], range(4)).indices == [0, 1, 2, 3]


@pytest.mark.skipif(native.extension() is None, reason="the Python fallback takes any number of views")
@pytest.mark.parametrize("keys", [2, 64])
def test_a_read_into_more_views_than_the_native_loads_take_is_a_config_error(tmp_path: Path, keys: int) -> None:
    chain = NS.block_keys(list(range(4 * keys)))
    with ucm_db.open(tmp_path / "s", codec="none") as store:
        store.put(NS, chain, [bytes([i]) * 2000 for i in range(keys)])
        # A first read teaches the process the stored frame tables: only then
        # does the native plan take these blocks (a first read decodes them).
        assert store.get_into(NS, chain, ScatterSlabs([bytearray(2000 * keys)], [2000], range(keys))) == [True] * keys
        slabs = ScatterSlabs([bytearray(keys)] * 2000, [1] * 2000, range(keys))
        with pytest.raises(ConfigError, match="1024"):
            store.get_into(NS, chain, slabs)
