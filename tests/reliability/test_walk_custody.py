"""The open's page walk is skipped only for a file nothing but LMDB wrote
since a clean walk, in this boot (the ledger: ucm_db/engines/lmdb/custody.py).

The walk is counted by wrapping the real ``check_pages_at_open`` (it still
runs); the damage is real (a reachable leaf page zeroed), and the processes
that die are killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.engines.lmdb import engine as lmdb_engine
from ucm_db.engines.lmdb.custody import RECORD_FILE, file_state, read_record
from ucm_db.engines.lmdb.meta import check_file

from .harness import NS, chain_tokens, payload_for
from .test_page_damage_at_open import BLOCKS, _reachable_lru_leaves, _store

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def walks(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The page walks run in this process (each still runs for real)."""
    seen: list[Path] = []
    real = lmdb_engine.check_pages_at_open

    def counted(env_dir: Path, **kwargs: Any) -> bool:
        seen.append(env_dir)
        return real(env_dir, **kwargs)

    monkeypatch.setattr(lmdb_engine, "check_pages_at_open", counted)
    return seen


def _reads_back(path: Path) -> int:
    with ucm_db.open(path) as store:
        return store.lookup(NS, NS.block_keys(chain_tokens("chain-3", BLOCKS)))


def test_a_file_only_lmdb_wrote_is_not_walked_again(tmp_path: Path, walks: list[Path]) -> None:
    data = _store(tmp_path / "s")
    walks.clear()  # the creating open's check of a file not there yet
    assert read_record(data.parent) == file_state(data), "the ledger follows the writer's commits"
    assert _reads_back(tmp_path / "s") == BLOCKS
    assert walks == [], "an unchanged file is not walked again"
    with ucm_db.open(tmp_path / "s") as store:  # its commits move the ledger on
        keys = NS.block_keys(chain_tokens("more", 2))
        store.put(NS, keys, [payload_for(k, 300) for k in keys])
    assert read_record(data.parent) == file_state(data)
    assert _reads_back(tmp_path / "s") == BLOCKS and walks == []


def test_another_boot_walks_again(tmp_path: Path, walks: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    _store(tmp_path / "s")
    walks.clear()
    monkeypatch.setenv("UCM_DB_BOOT_ID", "a-later-boot")
    assert _reads_back(tmp_path / "s") == BLOCKS
    assert len(walks) == 1, "after a reboot (an OS crash, maybe) every open walks"


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_a_write_outside_lmdb_is_walked_and_refused(tmp_path: Path, walks: list[Path], keep_mtime: bool) -> None:
    data = _store(tmp_path / "s")
    walks.clear()  # the creating open's check of a file not there yet
    before = data.stat()
    page_bytes = check_file(data).current.page_bytes  # type: ignore[union-attr]
    with open(data, "r+b") as f:
        f.seek(_reachable_lru_leaves(data)[1] * page_bytes)
        f.write(bytes(page_bytes))
    if keep_mtime:  # a tool that puts the modification time back still changes the change time
        os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(ucm_db.TierError, match="damaged pages"):
        ucm_db.open(tmp_path / "s").lookup(NS, NS.block_keys(chain_tokens("chain-3", BLOCKS)))
    assert len(walks) == 1


def test_a_damaged_or_foreign_record_means_a_walk(tmp_path: Path, walks: list[Path]) -> None:
    data = _store(tmp_path / "s")
    walks.clear()  # the creating open's check of a file not there yet
    (data.parent / RECORD_FILE).write_text("{not json")
    assert _reads_back(tmp_path / "s") == BLOCKS and len(walks) == 1
    assert read_record(data.parent) == file_state(data), "the clean walk vouches for it again"


_KILLED_WRITER = r"""
import os, signal, sys
import ucm_db
from tests.reliability.harness import NS, chain_tokens, payload_for
store = ucm_db.open(sys.argv[1])
keys = NS.block_keys(chain_tokens("killed", 3))
store.put(NS, keys, [payload_for(k, 300) for k in keys])
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_commits_of_a_killed_process_and_of_others_keep_the_ledger(tmp_path: Path, walks: list[Path]) -> None:
    """A vLLM engine writes from two processes (saves, recency) and its
    worker is killed at shutdown: the commits of all of them are LMDB's."""
    data = _store(tmp_path / "s")
    walks.clear()
    with ucm_db.open(tmp_path / "s") as store:
        done = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(tmp_path / "s")], cwd=REPO, capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
        keys = NS.block_keys(chain_tokens("after", 2))
        store.put(NS, keys, [payload_for(k, 300) for k in keys])
        assert read_record(data.parent) == file_state(data)
    assert _reads_back(tmp_path / "s") == BLOCKS and walks == [], "no walk after commits of processes alone"
    with ucm_db.open(tmp_path / "s") as store:
        assert store.lookup(NS, NS.block_keys(chain_tokens("killed", 3))) == 3


def test_a_write_while_open_is_walked_at_the_next_open(tmp_path: Path, walks: list[Path]) -> None:
    """Damage written into the file while a store is open, then a commit of
    that store: the commit finds the file in a state the ledger does not
    name and vouches for nothing, so the next open walks and refuses."""
    data = _store(tmp_path / "s")
    walks.clear()
    store = ucm_db.open(tmp_path / "s")
    assert store.lookup(NS, NS.block_keys(chain_tokens("chain-3", BLOCKS))) == BLOCKS
    leaves = _reachable_lru_leaves(data)
    page_bytes = check_file(data).current.page_bytes  # type: ignore[union-attr]
    with open(data, "r+b") as f:  # a leaf the next put does not rewrite: the damage stays reachable
        f.seek(leaves[1] * page_bytes)
        f.write(bytes(page_bytes))
    keys = NS.block_keys(chain_tokens("after", 1))
    store.put(NS, keys, [payload_for(k, 300) for k in keys])
    store.close()
    assert read_record(data.parent) != file_state(data)
    with pytest.raises(ucm_db.TierError, match="damaged pages"):
        ucm_db.open(tmp_path / "s").lookup(NS, keys)
    assert len(walks) == 1


def test_a_walk_that_could_not_finish_is_not_recorded(tmp_path: Path, walks: list[Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A mock of the timeout: a walk that outlasts its limit cannot be produced in a test's time."""
    from ucm_db.engines.lmdb import checks

    data = _store(tmp_path / "s")
    walks.clear()  # the creating open's check of a file not there yet
    (data.parent / RECORD_FILE).unlink()
    monkeypatch.setattr(checks, "OPEN_CHECK_TIMEOUT_S", 1e-6)
    assert _reads_back(tmp_path / "s") == BLOCKS
    assert read_record(data.parent) is None, "an unchecked open vouches for nothing, nor do its commits"
