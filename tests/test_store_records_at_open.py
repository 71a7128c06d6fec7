"""The store's own records at open, and the bounds of the options (issue 26
items 14, 18, 19, 21).

* A totals record of pre-checksum code is recounted before it is sealed: a
  garbage one never makes puts raise ``StoreFullError`` (item 18).
* A checksum-valid settings record holding an invalid value is refused at
  open as damage naming the field (never "raise capacity_bytes"), and
  ``verify`` exits 1 on it (item 19).
* ``format_version`` is checksummed like the settings record; stores of
  older code (no checksum) still open and are sealed then (item 19).
* ``capacity_bytes``, ``max_readers`` and ``sync_interval_s`` are bounded
  with errors naming the range; an LMDB map that does not fit the address
  space says so instead of "free disk space" (items 14, 21).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import ucm_db
from ucm_db import ConfigError, DamagedRecordError, Namespace
from ucm_db.index import records
from ucm_db.index.accounting import TOTALS, recount
from ucm_db.tools.cli import cli

NS = Namespace(model="records-at-open", kv_dtype="bfloat16", block_size=4)


def _store(path: Path, blocks: int = 3) -> None:
    with ucm_db.open(path, capacity_bytes=1 << 20, codec="none") as store:
        store.put(NS, NS.block_keys(list(range(4 * blocks))), [bytes([i]) * 1000 for i in range(blocks)])


def _as_format3_code_left_it(path: Path, change) -> None:  # type: ignore[no-untyped-def]
    """Drops every checksum sidecar (records as format-3 code wrote them),
    then lets ``change`` write bare records, through the real engine."""
    with ucm_db.open(path) as store:
        def run(txn):  # type: ignore[no-untyped-def]
            for name, _ in list(txn.scan("info", records.SUM_PREFIX)):
                txn.delete("info", bytes(name))
            change(txn)
        store._tier.engine.write(run)


def _verify(path: Path) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["verify", str(path)])
    return result.exit_code, result.output


# -- item 18 --------------------------------------------------------------------
def test_garbage_totals_of_pre_checksum_code_are_recounted_before_sealing(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _store(path)
    garbage = TOTALS.pack(3, 3000, (1 << 64) - 1_000_000, 0, 0, 0, 0)  # stored bytes near 2**64
    _as_format3_code_left_it(path, lambda txn: txn.put("info", b"totals", garbage))
    with ucm_db.open(path) as store:
        truth, _ = store._tier.engine.read(recount)
        assert 3000 < store._tier.totals().stored_bytes == truth.stored_bytes < 4000
        store.put(NS, NS.block_keys(list(range(100, 108))), [b"z" * 1000] * 2)  # no StoreFullError
        truth, _ = store._tier.engine.read(recount)
        assert store._tier.totals().stored_bytes == truth.stored_bytes and truth.blocks == 5
    assert _verify(path)[0] == 0


def test_intact_totals_of_pre_checksum_code_keep_their_event_counters(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _store(path)
    with ucm_db.open(path) as store:
        truth, _ = store._tier.engine.read(recount)
    intact = TOTALS.pack(3, truth.raw_bytes, truth.stored_bytes, 7, 0, 11, 13)
    _as_format3_code_left_it(path, lambda txn: txn.put("info", b"totals", intact))
    with ucm_db.open(path) as store:
        totals = store._tier.totals()
        assert (totals.blocks, totals.stored_bytes, totals.evictions) == (3, truth.stored_bytes, 7)
        assert (totals.hits, totals.misses) >= (11, 13)


# -- item 19: settings --------------------------------------------------------------
@pytest.mark.parametrize(("field", "value"), [("capacity_bytes", -5), ("codec", "lz4"), ("capacity_bytes", "8GiB")])
def test_a_sealed_settings_record_with_an_invalid_value_is_damage(tmp_path: Path, field: str, value: object) -> None:
    path = tmp_path / "s"
    _store(path)
    with ucm_db.open(path) as store:
        settings = json.loads(store._tier.info_get(b"settings"))
        settings[field] = value
        store._tier.engine.write(lambda txn: records.put_checked(txn, b"settings", json.dumps(settings).encode()))
    with pytest.raises(DamagedRecordError, match="settings record .* is damaged") as info:
        ucm_db.open(path)
    assert field in str(info.value) and repr(value) in str(info.value)
    assert f"raise {field}" not in info.value.hint and "move the store aside" in info.value.hint
    code, output = _verify(path)
    assert code == 1 and "settings" in output and field in output, output
    shown = CliRunner().invoke(cli, ["inspect", str(path), "--json"])
    assert any("'settings'" in line and field in line for line in json.loads(shown.output)["damaged_records"]), shown.output


# -- item 19: format_version ----------------------------------------------------------
def test_format_version_is_checksummed_and_a_changed_one_is_damage(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _store(path)
    with ucm_db.open(path) as store:
        assert store._tier.engine.read(lambda txn: txn.get("info", b"sum:format_version")) is not None
        store._tier.engine.write(lambda txn: txn.put("info", b"format_version", b"2"))  # a stray write, checksum not updated
    with pytest.raises(DamagedRecordError, match="format version record is damaged") as info:
        ucm_db.open(path)
    assert "migrate" not in str(info.value), "damage must not be taken for an old format"
    code, output = _verify(path)
    assert code == 1 and "format_version" in output, output


def test_a_bare_format_version_of_older_code_opens_and_is_sealed(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _store(path)
    _as_format3_code_left_it(path, lambda txn: None)
    with ucm_db.open(path, read_only=True) as store:  # read-only: trusted as it is, nothing written
        assert store._tier.engine.read(lambda txn: txn.get("info", b"sum:format_version")) is None
    with ucm_db.open(path) as store:
        assert store._tier.engine.read(lambda txn: txn.get("info", b"sum:format_version")) is not None
    assert _verify(path)[0] == 0


# -- items 14 and 21: bounds --------------------------------------------------------
@pytest.mark.parametrize(("option", "value", "words"), [
    ("capacity_bytes", 2**63, "capacity_bytes must be in [1048576, 4611686018427387904]"),
    ("capacity_bytes", 2**48, "128 TiB"),
    ("max_readers", 10**9, "max_readers must be in [8, 65536]"),
    ("sync_interval_s", 1e-9, "sync_interval_s must be a number of seconds in [0.001, 3600]"),
    ("map_size_bytes", 2**50, "map_size_bytes must be in"),
])
def test_out_of_range_options_name_the_range(tmp_path: Path, option: str, value: object, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        ucm_db.open(tmp_path / "s", **{option: value})
    assert words in str(info.value)
    assert not (tmp_path / "s" / "lmdb").exists() or option == "capacity_bytes"


def test_check_on_open_none_skips_the_page_check(tmp_path: Path) -> None:
    _store(tmp_path / "s")
    with ucm_db.open(tmp_path / "s", check_on_open="none") as store:
        assert store._tier.engine._check_pages is False  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="check_on_open must be one of pages, none"):
        ucm_db.open(tmp_path / "s", check_on_open="full")


def test_a_huge_capacity_within_range_fits_the_address_space() -> None:
    from ucm_db.config import MAX_LMDB_CAPACITY_BYTES, MAX_LMDB_MAP_BYTES, StoreConfig
    from ucm_db.format import configured_map_bytes

    assert configured_map_bytes(StoreConfig(capacity_bytes=MAX_LMDB_CAPACITY_BYTES)) <= MAX_LMDB_MAP_BYTES
    StoreConfig(capacity_bytes=2**50, engine="rocksdb")  # no map: only the counters' bound


_SMALL_ADDRESS_SPACE = r"""
import sys
import ucm_db
try:
    ucm_db.open(sys.argv[1], capacity_bytes=1 << 40).close()
    print("opened")
except ucm_db.TierError as exc:
    print(exc)
"""


def test_a_map_that_does_not_fit_the_address_space_says_so(tmp_path: Path) -> None:
    """A real ENOMEM from mmap: the child's address space is capped at 4 GiB."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    done = subprocess.run([sys.executable, "-c", _SMALL_ADDRESS_SPACE, str(tmp_path / "s")], capture_output=True,
                          text=True, timeout=60, preexec_fn=cap, check=False)
    assert "Cannot allocate memory" in done.stdout, done.stdout + done.stderr
    assert "address space" in done.stdout and "disk space does not help" in done.stdout
    assert "free space" not in done.stdout.replace("free disk space does not help", "")
