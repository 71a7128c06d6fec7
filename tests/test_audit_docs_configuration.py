"""docs/configuration.md's (and the README table's) ranges, choices, file
limits, environment variables and the constants the documents quote, each
held against the code, with the document's own words checked alongside so
that a change to either side fails here:

* every range the documents give is the range ``StoreConfig`` takes (both
  ends taken, one step past either refused with a ``ConfigError`` naming
  the option);
* every choice list the documents give is the code's;
* config files: size, depth, aliases (anchors alone are fine), encoding
  and the error line the document quotes;
* the environment variables the document lists are read by the code;
* the figures the documents quote (buffered touches, recency, batch-load
  units, frame groups, archive limits, the change feed's length).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import ConfigError
from ucm_db.config import CODECS, DURABILITIES, ENGINES, MAX_LMDB_CAPACITY_BYTES, OPEN_CHECKS, REMOTE_CODECS, REMOTE_MODES
from ucm_db.config import StoreConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")
MIB, TIB = 1 << 20, 1 << 40
REMOTE = {"remote": "memory://audit-docs-configuration"}

#: (option, what a document says of its range, where, taken values, refused values, other options it needs).
RANGES: list[tuple[str, str, str, list[Any], list[Any], dict[str, Any]]] = [
    ("capacity_bytes", "1 MiB to 2^62", CONFIGURATION, [MIB, 1 << 62], [MIB - 1, (1 << 62) + 1], {"engine": "memory"}),
    ("capacity_bytes", "`(2^46 - 256 MiB) / 2`, just under 32 TiB", CONFIGURATION,
     [MAX_LMDB_CAPACITY_BYTES], [MAX_LMDB_CAPACITY_BYTES + 1], {}),
    ("capacity_bytes", "`lmdb` at most about 32 TiB", README, [MAX_LMDB_CAPACITY_BYTES], [MAX_LMDB_CAPACITY_BYTES + 1], {}),
    ("zstd_level", "-7 to 22", CONFIGURATION, [-7, 1, 19, 22], [-8, 23], {}),
    ("sync_interval_s", "0.001 to 3600", CONFIGURATION, [0.001, 3600], [0.0009, 3600.5, float("nan")], {}),
    ("sync_interval_s", "0.001 to 3600 s", README, [0.001, 3600], [0.0009, 3601], {}),
    ("max_readers", "8 to 65536", CONFIGURATION, [8, 65536], [7, 65537], {}),
    ("max_readers", "8 to 65536", README, [8, 65536], [7, 65537], {}),
    ("map_size_bytes", "1 MiB to\n  64 TiB", CONFIGURATION, [MIB, 64 * TIB], [MIB - 1, 64 * TIB + 1], {}),
    ("map_size_bytes", "1 MiB to 64 TiB", README, [MIB, 64 * TIB], [MIB - 1, 64 * TIB + 1], {}),
    ("remote_deadline_s", "(at most 3600 s)", CONFIGURATION, [0.001, 3600], [0, 3601], REMOTE),
    ("encode_threads", "(0: all on the caller's thread)", CONFIGURATION, [0, 2], [-1], {}),
    ("max_pinned_bytes", "0 refuses every pin", CONFIGURATION, [0, 1 << 30], [-1], {}),
]


@pytest.mark.parametrize(("option", "said", "doc", "taken", "refused", "needs"), RANGES,
                         ids=[f"{row[0]}-{'readme' if row[2] is README else 'configuration'}" for row in RANGES])
def test_each_documented_range_is_the_one_taken(option: str, said: str, doc: str, taken: list[Any], refused: list[Any],
                                                 needs: dict[str, Any]) -> None:
    assert said in doc, f"the document no longer says {said!r} of {option}: update this table with it"
    for value in taken:
        assert getattr(StoreConfig(**needs, **{option: value}), option) == value
    for value in refused:
        with pytest.raises(ConfigError, match=option):
            StoreConfig(**needs, **{option: value})


def test_the_lmdb_capacity_limit_is_just_under_32_tib() -> None:
    assert MAX_LMDB_CAPACITY_BYTES == ((1 << 46) - (256 << 20)) // 2
    assert 31.99 * TIB < MAX_LMDB_CAPACITY_BYTES < 32 * TIB


#: (option, the choices as docs/configuration.md words them, the code's).
CHOICES = [
    ("codec", "`zstd` (level 1", CODECS),
    ("durability", "`sync`: fsync every commit. `group`", DURABILITIES),
    ("engine", "`lmdb` (several processes), `rocksdb` (one process), `memory` (tests)", ENGINES),
    ("check_on_open", "`pages`: before mapping", OPEN_CHECKS),
    ("remote_mode", "`write_back` (a durable upload queue drained in the background) or\n  `write_through`", REMOTE_MODES),
    ("remote_codec", "`same` as `codec`, `none`, `zstd`, or `auto`", REMOTE_CODECS),
]


@pytest.mark.parametrize(("option", "said", "choices"), CHOICES, ids=[row[0] for row in CHOICES])
def test_each_documented_choice_list_is_the_codes(option: str, said: str, choices: tuple[str, ...]) -> None:
    assert said in CONFIGURATION
    paragraph = CONFIGURATION.split(f"* `{option}` (default", 1)[1].split("\n* ", 1)[0]
    named = {word for word in re.findall(r"`(\w+)`", paragraph) if word.islower() and "_" not in word or word in choices}
    assert set(choices) <= named, f"{option}: the code takes {choices}, the document names {named}"
    needs = REMOTE if option.startswith("remote_") else {}
    for value in choices:
        assert getattr(StoreConfig(**needs, **{option: value}), option) == value
    with pytest.raises(ConfigError, match=option):
        StoreConfig(**needs, **{option: "no-such-choice"})


@pytest.mark.parametrize("option", ["remote_auth_key_file", "remote_auth_key_env", "remote_encryption_key_file",
                                    "remote_encryption_key_env", "read_only"])
def test_the_options_that_go_with_a_remote_or_without_one(option: str) -> None:
    """Key settings: "Only with `remote` set" (configuration.md; both kinds share
    the file format); ``read_only``: "not with `remote`"."""
    value = True if option == "read_only" else "/dev/null"
    with pytest.raises(ConfigError):
        StoreConfig(**({**REMOTE} if option == "read_only" else {}), **{option: value})


# -- config files ---------------------------------------------------------------------------------
def _load(tmp_path: Path, name: str, content: str | bytes) -> Any:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return ucm_db.load_config_file(path)


def test_config_files_are_bounded_as_the_document_says(tmp_path: Path) -> None:
    from ucm_db.config.file import MAX_CONFIG_DEPTH, MAX_CONFIG_FILE_BYTES

    assert (MAX_CONFIG_FILE_BYTES, MAX_CONFIG_DEPTH) == (1 << 20, 32)
    assert "at most 1 MiB (`MAX_CONFIG_FILE_BYTES`)" in CONFIGURATION and "nested at most 32 deep" in CONFIGURATION
    filler = "a: " + "x" * (MIB - 4) + "\n"
    assert len(_load(tmp_path, "full.yaml", filler)["a"]) == MIB - 4
    with pytest.raises(ConfigError, match="not a regular file of at most"):
        _load(tmp_path, "over.yaml", filler + "#")
    assert _load(tmp_path, "deep.yaml", "a: " + "[" * 31 + "]" * 31 + "\n")  # 32 levels with the mapping
    with pytest.raises(ConfigError, match="nested over 32 deep"):
        _load(tmp_path, "deeper.yaml", "a: " + "[" * 32 + "]" * 32 + "\n")
    with pytest.raises(ConfigError, match="UTF-8"):
        _load(tmp_path, "latin1.yaml", b"codec: \xe9\n")
    # An anchor nothing refers to is harmless and taken; any alias is refused.
    assert "YAML without aliases (`*name`; an anchor `&name` that nothing refers to is harmless)" in CONFIGURATION
    assert _load(tmp_path, "anchor.yaml", "codec: &c none\n") == {"codec": "none"}
    with pytest.raises(ConfigError, match="an alias"):
        _load(tmp_path, "alias.yaml", "codec: &c none\nremote_codec: *c\n")
    # The error line the document quotes, word for word.
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, "ucm.yaml", "a: [1, 2\n")
    quoted = re.search(r"e\.g\. `config file /etc/ucm\.yaml (is not valid YAML:\n  .*?)`", CONFIGURATION, flags=re.DOTALL)
    assert quoted, "configuration.md no longer quotes a YAML syntax error"
    assert str(info.value).endswith(quoted[1].replace("\n  ", " "))
    with pytest.raises(ConfigError, match="not a regular file"):
        ucm_db.load_config_file(tmp_path)  # "a directory, a FIFO or a device ... is refused before anything is read"


# -- environment variables and quoted figures -------------------------------------------------------
def test_every_environment_variable_the_document_lists_is_read_by_the_code() -> None:
    listed = re.findall(r"^\* `(UCM_DB_\w+)", CONFIGURATION.split("## Environment variables", 1)[1], flags=re.MULTILINE)
    assert len(listed) >= 5
    sources = "\n".join(p.read_text(encoding="utf-8") for folder in ("ucm_db", "connector", "tools")
                        for p in (ROOT / folder).rglob("*.py"))
    unread = [name for name in listed if not re.search(rf"[\"']{name}[\"']", sources)]
    assert not unread


def test_the_figures_the_documents_quote_are_the_codes() -> None:
    from ucm_db.codec import MAX_RAW_BYTES, ZSTD_GROUP_BYTES
    from ucm_db.codec.batch_loads import FLUSH_UNITS
    from ucm_db.codec.pool import POOL_MIN_FRAME_BYTES
    from ucm_db.events import FEED_MAX_RECORDS
    from ucm_db.maintenance.archive import BATCH_BYTES, MAX_MEMBER_BYTES
    from ucm_db.maintenance.archive.files import MAX_MANIFEST_DEPTH, READ_CHUNK_BYTES
    from ucm_db.maintenance.archive.manifest import MAX_MANIFEST_BYTES
    from ucm_db.remote.tombstones import TOMBSTONE_MAX_AGE_S
    from ucm_db.store.background import ACTIVITY_FLUSH_KEYS, RECENCY_REFRESH_S

    api, cli_md = (ROOT / "docs" / "api.md").read_text(encoding="utf-8"), (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    quoted = [
        (CONFIGURATION, "sooner once 4,096 touches are buffered", ACTIVITY_FLUSH_KEYS, 4096),
        (CONFIGURATION, "in the last 30 s", RECENCY_REFRESH_S, 30.0),
        (README, "at most once per 30 s", RECENCY_REFRESH_S, 30.0),
        (CONFIGURATION, "frames of 512 KiB or more", POOL_MIN_FRAME_BYTES, 512 << 10),
        (api, "64 at a time (`FLUSH_UNITS`)", FLUSH_UNITS, 64),
        (api, "a block over 4 GiB (`ucm_db.codec.MAX_RAW_BYTES`", MAX_RAW_BYTES, 4 << 30),
        (api, "up to 256 KiB", ZSTD_GROUP_BYTES, 256 << 10),
        (cli_md, "The feed keeps the last 100,000 records", FEED_MAX_RECORDS, 100_000),
        (cli_md, "the manifest up to 256 MiB", MAX_MANIFEST_BYTES, 256 << 20),
        (cli_md, "16 levels of JSON", MAX_MANIFEST_DEPTH, 16),
        (cli_md, "each in 1 MiB chunks", READ_CHUNK_BYTES, MIB),
        (cli_md, "block up to 512 MiB", MAX_MEMBER_BYTES, 512 << 20),
        (cli_md, "batches of at most\n256 MiB", BATCH_BYTES, 256 << 20),
        (cli_md, "those over 7 days old are removed", TOMBSTONE_MAX_AGE_S, 7 * 86400.0),
    ]
    wrong = [(said, actual) for doc, said, actual, stated in quoted if said not in doc or actual != stated]
    assert not wrong, f"quoted figure (or its words) -> the code's value: {wrong}"
