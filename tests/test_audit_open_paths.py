"""Audit of how ``ucm_db.open`` names its store directory (real directories,
real symlinks): the store keeps the directory it opened, whatever happens
to the name afterwards (a ``chdir``, a symlink swapped), and a path no
engine can take is refused with a ConfigError before anything is created.

Found by the store-path audit:
* a relative path opened, then ``os.chdir``: ``flush`` and ``close`` raised
  TierError (``rel/lmdb/data.mdb`` not found) -- files were looked up again
  relative to the new working directory;
* a symlinked store directory swapped to another store while open:
  ``close`` raised "the newest snapshot's meta page is not in data.mdb's
  meta slots" -- it read the *other* store's data file;
* a name that is not UTF-8 (``b"\\xff"``): raw UnicodeEncodeError from the
  engine, after the directory was created;
* a path under the name limits but too long for the store's own files
  below it: raw OSError (ENAMETOOLONG);
* a NUL character: raw ValueError;
* ``open("~/kv")``: a directory named ``~`` created in the working directory;
* opening the parent directory of a store created a store around it, after
  which the first store was "inside another store" and refused for good.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ucm_db
from ucm_db import ConfigError, Namespace

NS = Namespace(model="audit-open", kv_dtype="bfloat16", block_size=4)
KEYS = NS.block_keys(list(range(8)))
PAYLOADS = [b"a" * 300, b"b" * 300]


def test_a_relative_path_keeps_its_store_after_chdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    monkeypatch.chdir(tmp_path / "first")
    store = ucm_db.open("rel", durability="group")
    monkeypatch.chdir(tmp_path / "second")
    store.put(NS, KEYS, PAYLOADS)
    store.flush()  # raised TierError: rel/lmdb/data.mdb looked up under "second"
    store.close()
    assert not (tmp_path / "second" / "rel").exists()
    with ucm_db.open(tmp_path / "first" / "rel", read_only=True) as again:
        assert again.lookup(NS, KEYS) == 2


def test_a_symlink_swapped_while_open_leaves_the_open_store_on_its_directory(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "one")
    first = ucm_db.open(link)
    first.put(NS, KEYS[:1], PAYLOADS[:1])
    link.unlink()
    link.symlink_to(tmp_path / "two")  # e.g. a deploy switching a "current" link
    with ucm_db.open(link) as second:  # the link's new target: another, empty store
        assert second.lookup(NS, KEYS) == 0
        second.put(NS, KEYS, [b"c" * 300, b"d" * 300])
    first.put(NS, KEYS, PAYLOADS)
    first.close()  # raised TierError: it read two/lmdb/data.mdb's meta pages
    with ucm_db.open(tmp_path / "one", read_only=True) as one:
        assert one.get(NS, KEYS) == PAYLOADS


def test_a_name_that_is_not_utf8_is_a_config_error_creating_nothing(tmp_path: Path) -> None:
    path = tmp_path / os.fsdecode(b"store-\xff")
    with pytest.raises(ConfigError, match="UTF-8") as raised:
        ucm_db.open(path)
    assert raised.value.hint
    assert list(tmp_path.iterdir()) == []


def _deep_path(tmp_path: Path, total_bytes: int) -> Path:
    """A path of exactly ``total_bytes`` bytes, each name under 255 bytes."""
    path = str(tmp_path)
    while len(path) < total_bytes - 250:
        path += "/" + "d" * 200
    return Path(path + "/" + "e" * (total_bytes - len(path) - 1))


def test_a_path_too_long_for_the_files_inside_the_store_is_a_config_error(tmp_path: Path) -> None:
    path = _deep_path(tmp_path, 4080)  # under PATH_MAX, but not "PATH/rocksdb/OPTIONS-000007.dbtmp"
    with pytest.raises(ConfigError, match="bytes long") as raised:
        ucm_db.open(path)
    assert "shorter" in raised.value.hint
    assert list(tmp_path.iterdir()) == []


def test_a_trailing_slash_and_a_dot_name_the_same_store(tmp_path: Path) -> None:
    with ucm_db.open(f"{tmp_path}/s/") as store:
        store.put(NS, KEYS, PAYLOADS)
    with ucm_db.open(f"{tmp_path}/./s//", read_only=True) as store:
        assert store.lookup(NS, KEYS) == 2


def test_creating_a_store_around_an_existing_one_is_refused(tmp_path: Path) -> None:
    """Opening the parent of a store (e.g. the cache directory instead of
    ``~/.cache/ucm-db``) created a second store there, after which the first
    one lay "inside another store" and every open of it was refused."""
    with ucm_db.open(tmp_path / "parent" / "inner") as inner:
        inner.put(NS, KEYS, PAYLOADS)
    with pytest.raises(ConfigError, match="holds the ucm-db store") as raised:
        ucm_db.open(tmp_path / "parent")
    assert str(tmp_path / "parent" / "inner") in raised.value.hint
    assert sorted(p.name for p in (tmp_path / "parent").iterdir()) == ["inner"], "nothing created"
    with ucm_db.open(tmp_path / "parent" / "inner", read_only=True) as again:
        assert again.lookup(NS, KEYS) == 2


def test_a_nul_character_is_a_config_error(tmp_path: Path) -> None:
    """It was a bare ValueError ("embedded null byte") from os.path; the
    connector's ``path`` refuses it as a ConfigError already."""
    with pytest.raises(ConfigError, match="NUL") as raised:
        ucm_db.open(f"{tmp_path}/a\x00b")
    assert raised.value.hint


def test_a_tilde_path_is_refused_rather_than_creating_a_directory_named_tilde(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``ucm_db.open("~/kv")`` created ``./~/kv`` in the working directory (the
    connector's ``path`` expands ``~``; open, like Python's own open, does
    not), a directory whose removal (``rm -rf ~``) is a well-known disaster."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="does not expand") as raised:
        ucm_db.open("~/kv")
    assert "expanduser" in raised.value.hint
    assert list(tmp_path.iterdir()) == []
    with ucm_db.open("./~/kv"):  # a directory really named "~": the hint's way
        pass
    with ucm_db.open("~/kv", read_only=True) as again:  # once it exists, the name is taken as written
        assert again.path == tmp_path / "~" / "kv"


def test_a_symlink_to_nothing_is_refused_creating_nothing(tmp_path: Path) -> None:
    """A dangling link and a link loop were both a TierError "is a file, not
    a directory" (misleading); with the path resolved at open (the fix for
    a swapped link) a dangling link would be followed and its target's
    directories created -- a link onto a disk not mounted would put the
    store on the root disk. Now both are named, and nothing is created."""
    (tmp_path / "dangling").symlink_to(tmp_path / "unmounted" / "kv")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for name in ("dangling", "dangling/sub", "loop"):
        with pytest.raises(ConfigError, match="leads nowhere") as raised:
            ucm_db.open(tmp_path / name)
        assert "link" in raised.value.hint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "loop"]
