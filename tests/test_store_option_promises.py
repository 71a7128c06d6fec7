"""The store options' promises in README.md's configuration table and
docs/configuration.md, held on real LMDB stores through ``ucm_db.open``.

* Every ``StoreConfig`` field has a row in the README's table, and each
  row's default is what a fresh store runs with (derived defaults where
  the public API shows them).
* ``zstd_level`` is recorded at creation, reused on reopen, a conflicting
  one is refused with the fix in its hint, and a higher level stores fewer
  bytes.
* A store smaller than 64 MiB syncs every half of its capacity (at least
  1 MiB) rather than every ``sync_bytes``.
* Out-of-range options are a ``ConfigError`` naming the option, before a
  store directory exists.
* ``encode_threads=0`` starts no codec thread; ``check_on_open`` and
  ``read_only`` are never persisted.
"""

from __future__ import annotations

import ast
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucm_db
from ucm_db import ConfigError, Namespace
from ucm_db.components import remote_link
from ucm_db.config import MAX_REMOTE_OBJECT_BYTES, StoreConfig

NS = Namespace(model="option-promises", kv_dtype="bfloat16", block_size=4)
README = Path(__file__).resolve().parents[1] / "README.md"
MIB = 1 << 20
#: The codec pool's thread names (ThreadPoolExecutor prefix in ucm_db/codec/pool.py).
CODEC_THREAD_PREFIX = "ucm-db-codec"
#: README cells whose default is derived from other options, each held by a test of its own below.
DERIVED = {
    "map_size_bytes": "derived",
    "max_pinned_bytes": "half of `capacity_bytes`",
    "remote_lookup_max_bytes": "512 MiB (or `remote_max_object_bytes` if larger)",
}


def _store_rows() -> dict[str, str]:
    """``option -> default cell`` of the README table's rows above its
    connector keys (connector rows are held in tests/connector/test_settings.py)."""
    text = README.read_text(encoding="utf-8")
    table = text[text.index("| option | default |"):]
    store_part = table[:table.index("| **connector keys** |")]
    return dict(re.findall(r"^\| `(\w+)` \| ([^|]*?) \|", store_part, flags=re.MULTILINE))


def _readme_value(cell: str) -> Any:
    """The value a README default cell states: ``off`` is None, ``8 GiB`` a
    byte count, a backquoted word a string or Python literal, else a number."""
    if cell == "off":
        return None
    sized = re.fullmatch(r"(\d+) (KiB|MiB|GiB)", cell)
    if sized:
        return int(sized[1]) << {"KiB": 10, "MiB": 20, "GiB": 30}[sized[2]]
    if re.fullmatch(r"`[^`]*`", cell):
        try:
            return ast.literal_eval(cell[1:-1])
        except (ValueError, SyntaxError):
            return cell[1:-1]
    return ast.literal_eval(cell)


def _bf16_blocks(n: int, size: int, seed: int = 7) -> list[bytes]:
    """bfloat16-like blocks of a smooth signal: zstd compresses them, more at higher levels."""
    rng = np.random.default_rng(seed)
    walks = [np.cumsum(rng.standard_normal(size // 2).astype(np.float32) * 0.01) for _ in range(n)]
    return [(walk.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes() for walk in walks]


def _codec_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(CODEC_THREAD_PREFIX)}


def _unsynced_stays(store: ucm_db.Store, wait_s: float = 0.5) -> bool:
    time.sleep(wait_s)
    return store._activity.unsynced_bytes > 0


def _synced_within(store: ucm_db.Store, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while store._activity.unsynced_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    return store._activity.unsynced_bytes == 0


# -- the README's table ---------------------------------------------------------------
def test_readme_table_has_a_row_for_every_store_option_and_no_other() -> None:
    assert set(_store_rows()) == set(StoreConfig.field_names())


def test_readme_defaults_are_a_fresh_stores_config(tmp_path: Path) -> None:
    rows = _store_rows()
    with ucm_db.open(tmp_path / "s") as store:
        config = store.config
    wrong = {}
    for name, cell in rows.items():
        if name in DERIVED:
            continue
        stated, actual = _readme_value(cell), getattr(config, name, "(no such option)")
        if stated != actual or isinstance(stated, bool) != isinstance(actual, bool):
            wrong[name] = (cell, actual)
    assert not wrong, f"README default -> fresh store's config: {wrong}"
    assert {name: rows[name] for name in DERIVED} == DERIVED
    # "derived" states no value: the README promises only that the store derives it (it is left unset).
    assert config.map_size_bytes is None


def test_readme_pin_cap_default_is_half_the_capacity(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "default") as store:
        assert store.stats().max_pinned_bytes == store.config.capacity_bytes // 2 == 4 << 30
    with ucm_db.open(tmp_path / "small", capacity_bytes=256 * MIB) as store:
        assert store.stats().max_pinned_bytes == 128 * MIB


def test_readme_lookup_budget_default_is_512_mib_or_the_largest_object(tmp_path: Path) -> None:
    remote = f"memory://option-promises-{tmp_path.name}"
    with ucm_db.open(tmp_path / "default", remote=remote + "/a") as store:
        link = remote_link(store)
        assert link is not None and link.lookup_max_bytes == 512 * MIB
    with ucm_db.open(tmp_path / "larger", remote=remote + "/b", remote_max_object_bytes=600 * MIB) as store:
        link = remote_link(store)
        assert link is not None and link.lookup_max_bytes == 600 * MIB


# -- zstd_level -------------------------------------------------------------------------
def test_zstd_level_is_recorded_at_creation_and_reused_on_reopen(tmp_path: Path) -> None:
    data = _bf16_blocks(4, 64 << 10)
    with ucm_db.open(tmp_path / "s", zstd_level=19, capacity_bytes=64 * MIB) as store:
        store.put(NS, NS.block_keys(list(range(16))), data)
        at_creation = store.stats().stored_bytes
    with ucm_db.open(tmp_path / "s") as store:
        assert store.config.zstd_level == 19
        store.put(NS, NS.block_keys(list(range(1000, 1016))), data)
        assert store.stats().stored_bytes == 2 * at_creation


def test_reopening_with_another_zstd_level_is_a_conflict_whose_hint_names_the_fix(tmp_path: Path) -> None:
    ucm_db.open(tmp_path / "s", zstd_level=5).close()
    with pytest.raises(ConfigError) as info:
        ucm_db.open(tmp_path / "s", zstd_level=3)
    assert "zstd_level=3 conflicts with the store" in str(info.value)
    assert "created with zstd_level=5" in str(info.value)
    assert "omit zstd_level to use the stored setting" in info.value.hint
    with ucm_db.open(tmp_path / "s") as store:
        assert store.config.zstd_level == 5


def test_a_higher_zstd_level_stores_fewer_bytes(tmp_path: Path) -> None:
    data, keys = _bf16_blocks(8, 64 << 10), NS.block_keys(list(range(32)))
    stored = {}
    for level in (1, 19):
        with ucm_db.open(tmp_path / f"level{level}", zstd_level=level, capacity_bytes=64 * MIB) as store:
            store.put(NS, keys, data)
            stats = store.stats()
            assert stats.raw_bytes == 8 * (64 << 10)
            stored[level] = stats.stored_bytes
    assert stored[19] < stored[1] < 8 * (64 << 10)


# -- the small-store sync budget ----------------------------------------------------------
@pytest.mark.parametrize(("capacity_bytes", "budget_bytes"), [
    (1 * MIB, 1 * MIB),  # half would be 512 KiB: at least 1 MiB
    (3 * MIB, 3 * MIB // 2),
    (63 * MIB, 63 * MIB // 2),
    (64 * MIB, 32 * MIB),
    (1 << 30, 32 * MIB),
])
def test_sync_budget_is_half_a_small_stores_capacity_at_least_1_mib(tmp_path: Path, capacity_bytes: int, budget_bytes: int) -> None:
    with ucm_db.open(tmp_path / "s", capacity_bytes=capacity_bytes) as store:
        assert store.config.sync_bytes == 32 * MIB
        assert store._activity.sync_budget_bytes == budget_bytes


def test_a_4_mib_store_syncs_once_half_its_capacity_is_unsynced(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=4 * MIB, sync_interval_s=3600) as store:
        keys = NS.block_keys(list(range(8)))
        store.put(NS, keys[:1], [bytes(3 * MIB // 2)])
        assert _unsynced_stays(store), "synced before 2 MiB were unsynced"
        store.put(NS, keys[1:2], [bytes(1 * MIB)], parent=keys[0])
        assert _synced_within(store), "no sync after 2.5 MiB: the budget is not half the capacity"


def test_a_1_mib_store_syncs_after_1_mib_not_half_its_capacity(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", codec="none", capacity_bytes=1 * MIB, sync_interval_s=3600) as store:
        keys = NS.block_keys(list(range(8)))
        store.put(NS, keys[:1], [bytes(700 << 10)])
        assert _unsynced_stays(store), "synced at 700 KiB: the budget is below its 1 MiB floor"
        store.put(NS, NS.block_keys(list(range(100, 104))), [bytes(400 << 10)])  # evicts the first: 1 MiB capacity
        assert _synced_within(store), "no sync after 1.1 MiB"


# -- option ranges ---------------------------------------------------------------------------
@pytest.mark.parametrize(("option", "value"), [
    ("zstd_level", 23),
    ("remote_deadline_s", 0),
    ("remote_deadline_s", 3601),
    ("remote_deadline_s", float("nan")),
    ("max_readers", 7),
    ("map_size_bytes", MIB - 1),
    ("remote_mode", "later"),
    ("remote_codec", "lz4"),
    ("upload_concurrency", 0),
    ("remote_read_concurrency", 0),
    ("remote_max_object_bytes", MAX_REMOTE_OBJECT_BYTES + 1),
])
def test_an_out_of_range_option_is_refused_naming_it_before_a_store_exists(tmp_path: Path, option: str, value: object) -> None:
    remote = {"remote": f"memory://option-promises-{tmp_path.name}"} if option.startswith(("remote_", "upload_")) else {}
    with pytest.raises(ConfigError) as info:
        ucm_db.open(tmp_path / "s", **remote, **{option: value})
    assert str(info.value).startswith(option), str(info.value)
    assert not (tmp_path / "s").exists()


# -- encode_threads ----------------------------------------------------------------------------
@pytest.mark.parametrize(("encode_threads", "starts_codec_threads"), [(0, False), (2, True)])
def test_encode_threads_0_keeps_codec_work_on_the_callers_thread(tmp_path: Path, encode_threads: int,
                                                                 starts_codec_threads: bool) -> None:
    data, keys = _bf16_blocks(4, MIB), NS.block_keys(list(range(16)))
    before = _codec_threads()
    with ucm_db.open(tmp_path / "s", codec="zstd", encode_threads=encode_threads) as store:
        store.put(NS, keys, data)
        assert [None if block is None else bytes(block) for block in store.get(NS, keys)] == data
        assert store.stats().stored_bytes < store.stats().raw_bytes
        started = _codec_threads() - before
    assert bool(started) is starts_codec_threads, sorted(t.name for t in started)


# -- never persisted ------------------------------------------------------------------------------
def test_check_on_open_and_read_only_are_never_persisted(tmp_path: Path) -> None:
    keys = NS.block_keys(list(range(8)))
    with ucm_db.open(tmp_path / "s", check_on_open="none", capacity_bytes=64 * MIB) as store:
        assert store.config.check_on_open == "none"
        store.put(NS, keys[:1], [b"a" * 1000])
    with ucm_db.open(tmp_path / "s") as store:
        assert store.config.check_on_open == "pages"
    with ucm_db.open(tmp_path / "s", read_only=True) as store:
        assert store.config.read_only is True
    with ucm_db.open(tmp_path / "s") as store:
        assert store.config.read_only is False
        assert store.put(NS, keys[1:], [b"b" * 1000], parent=keys[0]).stored == 1
        assert store.config.capacity_bytes == 64 * MIB
