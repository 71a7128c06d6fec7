"""The open's page walk is skipped only for a file nothing but LMDB wrote
since a clean walk, in this boot (ucm_db/engines/lmdb/custody.py).

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


def test_a_clean_close_lets_the_next_open_skip_the_walk(tmp_path: Path, walks: list[Path]) -> None:
    data = _store(tmp_path / "s")
    walks.clear()  # the creating open's check of a file not there yet
    assert read_record(data.parent) == file_state(data), "the writer's clean close records the file's state"
    assert _reads_back(tmp_path / "s") == BLOCKS
    assert walks == [], "an unchanged file is not walked again"
    with ucm_db.open(tmp_path / "s") as store:  # a handle that commits keeps custody through its own commits
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
    assert read_record(data.parent) == file_state(data), "the clean walk and close record it again"


_KILLED_WRITER = r"""
import os, signal, sys
import ucm_db
from tests.reliability.harness import NS, chain_tokens, payload_for
store = ucm_db.open(sys.argv[1])
keys = NS.block_keys(chain_tokens("killed", 3))
store.put(NS, keys, [payload_for(k, 300) for k in keys])
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_writer_leaves_no_record_of_what_it_wrote(tmp_path: Path, walks: list[Path]) -> None:
    data = _store(tmp_path / "s")
    walks.clear()  # the creating open's check of a file not there yet
    done = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(tmp_path / "s")], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert read_record(data.parent) != file_state(data), "the record is the state before the killed process wrote"
    assert _reads_back(tmp_path / "s") == BLOCKS and len(walks) == 1


_SECOND_WRITER = r"""
import sys
import ucm_db
from tests.reliability.harness import NS, chain_tokens, payload_for
with ucm_db.open(sys.argv[1]) as store:
    keys = NS.block_keys(chain_tokens("other", 2))
    store.put(NS, keys, [payload_for(k, 300) for k in keys])
"""


def test_a_handle_that_saw_another_process_commit_records_nothing(tmp_path: Path, walks: list[Path]) -> None:
    data = _store(tmp_path / "s")
    walks.clear()  # the creating open's check of a file not there yet
    with ucm_db.open(tmp_path / "s") as store:
        assert store.lookup(NS, NS.block_keys(chain_tokens("chain-3", BLOCKS))) == BLOCKS
        (data.parent / RECORD_FILE).unlink()
        done = subprocess.run([sys.executable, "-c", _SECOND_WRITER, str(tmp_path / "s")], cwd=REPO,
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        recorded = read_record(data.parent)
        assert recorded == file_state(data), "the other process closed in custody of its own commit"
        keys = NS.block_keys(chain_tokens("after", 2))
        store.put(NS, keys, [payload_for(k, 300) for k in keys])  # its custody broke at this commit's start
    assert read_record(data.parent) == recorded != file_state(data), "no record of a state this handle did not see whole"
    assert _reads_back(tmp_path / "s") == BLOCKS and len(walks) == 1


def test_a_walk_that_could_not_finish_is_not_recorded(tmp_path: Path, walks: list[Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A mock of the timeout: a walk that outlasts its limit cannot be produced in a test's time."""
    from ucm_db.engines.lmdb import checks

    data = _store(tmp_path / "s")
    walks.clear()  # the creating open's check of a file not there yet
    (data.parent / RECORD_FILE).unlink()
    monkeypatch.setattr(checks, "OPEN_CHECK_TIMEOUT_S", 1e-6)
    assert _reads_back(tmp_path / "s") == BLOCKS
    assert not (data.parent / RECORD_FILE).exists(), "an unchecked open vouches for nothing"
