"""The persisted fingerprint cache (``$XDG_CACHE_HOME/ucm-db/fingerprints.json``)
supplies a file's digest wherever an entry's stats match: whoever can write
it can give one model another's namespace (the audit's
``fingerprint_cache_spoof.py``). It is kept private (directory 0700, file
and lock 0600, written atomically) and a cache file that another user owns
or that group or others may write is ignored with a warning, then replaced
(``connector/fingerprint_cache.py``, ``docs/trust.md``).

Real files; the tests run as root, so "another user" is a file chowned to
``nobody``.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from ucm_db.connector import fingerprints  # noqa: E402
from ucm_db.connector.fingerprints import fingerprint  # noqa: E402

from test_identity_inputs import own_caches  # noqa: E402,F401 - autouse: each test its own fingerprint cache

NOBODY = 65534


@pytest.fixture(autouse=True)
def persisted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fingerprints, "PERSIST_MIN_BYTES", 1)  # every checkpoint through the cache file


@pytest.fixture()
def warnings_logged() -> Iterator[list[str]]:
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("vllm.ucm_db.connector")
    log.addHandler(handler)
    yield lines
    log.removeHandler(handler)


def _model(path: Path, byte: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(byte * 4096)
    return path


def _spoof(cache: Path, victim: Path, source: Path) -> None:
    """Gives ``victim``'s entries ``source``'s digests, keeping ``victim``'s stats (as the audit did)."""
    data = json.loads(cache.read_text())
    theirs, ours = data["dirs"][str(source)]["files"], data["dirs"][str(victim)]["files"]
    for name in ours:
        ours[name][4] = theirs[name][4]
    cache.write_text(json.dumps(data))


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_cache_is_created_private(tmp_path: Path, own_caches: Path) -> None:
    fingerprint(_model(tmp_path / "a", b"a"))
    assert _mode(own_caches.parent) == 0o700
    assert _mode(own_caches) == 0o600
    assert _mode(own_caches.with_suffix(".lock")) == 0o600
    assert not list(own_caches.parent.glob("*.tmp"))


def test_an_existing_cache_directory_is_made_private(tmp_path: Path, own_caches: Path) -> None:
    own_caches.parent.mkdir(parents=True, mode=0o755)
    own_caches.parent.chmod(0o755)  # as an older ucm-db left it
    fingerprint(_model(tmp_path / "a", b"a"))
    assert _mode(own_caches.parent) == 0o700 and _mode(own_caches) == 0o600


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "another-user"])
def test_a_cache_file_others_could_write_supplies_no_digest(tmp_path: Path, own_caches: Path, how: str,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            warnings_logged: list[str]) -> None:
    a, b = _model(tmp_path / "A", b"a"), _model(tmp_path / "B", b"b")
    digest_a, digest_b = fingerprint(a).digest, fingerprint(b).digest
    _spoof(own_caches, b, a)
    if how == "another-user":
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(own_caches, NOBODY, NOBODY)
    else:
        own_caches.chmod(0o620 if how == "group-writable" else 0o606)
    monkeypatch.setattr(fingerprints, "_memo", {})  # a new process
    again = fingerprint(b)
    assert again.digest == digest_b != digest_a  # rehashed from the files
    assert again.hashed_bytes == again.total_bytes
    assert any("fingerprints.json" in line and "ignored" in line for line in warnings_logged), warnings_logged
    # Replaced by a private file of this user's, which the next start trusts.
    assert _mode(own_caches) == 0o600 and own_caches.stat().st_uid == os.geteuid()
    monkeypatch.setattr(fingerprints, "_memo", {})
    assert fingerprint(b).hashed_bytes == 0


def test_a_private_cache_file_is_still_trusted(tmp_path: Path, own_caches: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner of the cache is the serving user: what that user writes
    there is trusted like its model files (docs/trust.md)."""
    model = _model(tmp_path / "A", b"a")
    first = fingerprint(model)
    monkeypatch.setattr(fingerprints, "_memo", {})
    assert (fingerprint(model).digest, fingerprint(model).hashed_bytes) == (first.digest, 0)


def test_a_link_in_place_of_the_cache_file_is_not_followed(tmp_path: Path, own_caches: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _model(tmp_path / "A", b"a"), _model(tmp_path / "B", b"b")
    digest_b = fingerprint(b).digest
    fingerprint(a)
    planted = tmp_path / "planted.json"
    planted.write_text(own_caches.read_text())
    planted.chmod(0o600)
    _spoof(planted, b, a)
    own_caches.unlink()
    own_caches.symlink_to(planted)
    monkeypatch.setattr(fingerprints, "_memo", {})
    assert fingerprint(b).digest == digest_b
    assert json.loads(planted.read_text())["dirs"][str(b)]["files"] != {}  # the link's target was not written through
    assert not own_caches.is_symlink()
