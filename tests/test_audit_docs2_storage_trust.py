"""docs/storage.md's and docs/trust.md's promises, held on real stores (LMDB,
RocksDB, a ``file://`` remote), with the documents' own words checked beside
the code so that a change to either side fails here:

* storage.md: the namespace digest is SHA-256 of every field (a rank
  included), keys are BLAKE2b chains seeded by it; the files a group store
  keeps (``lmdb/synced-snapshot.<pid>.<token>``, ``lmdb/walked-clean``); the
  LMDB fence's bound, variable and proven versions; the prefault's bounds
  and switch; the header's table (store format 3); the compiled codec; a
  read-only RocksDB open writes nothing in the store and its temp
  directory (``ucm-db-rocksdb-ro-*``, under ``TMPDIR``) goes at close.
* trust.md: the store directory 0700 and its files 0600; the key-file
  rules (hex of 32 to 64 bytes, ``#`` comments, mode 600 or 640, else a
  ``ConfigError``); the counters a refused object is counted in; a keyless
  node on a keyed or encrypted remote; the records and markers named;
  archives' keys (refusals exit 2 and write nothing; pins stay local); the
  object and archive formats and the HKDF-derived AES key.
* all six deeper documents: every ``ucm-db`` command, benchmark and flag
  they name exists, and every file and link (with its anchor) they name.
"""

from __future__ import annotations

import hashlib
import json
import re
import os
import stat
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

import ucm_db
from ucm_db import ConfigError

ROOT = Path(__file__).resolve().parents[1]
STORAGE = (ROOT / "docs" / "storage.md").read_text(encoding="utf-8")
TRUST = (ROOT / "docs" / "trust.md").read_text(encoding="utf-8")
NS = ucm_db.Namespace(model="audit/storage", kv_dtype="bfloat16", block_size=4)
KEYS = NS.block_keys(list(range(40)))
DATA = [bytes([i + 1]) * 4096 for i in range(10)]


def _flat(text: str) -> str:
    return " ".join(text.split())


# -- storage.md: keys ------------------------------------------------------------------------------
def test_the_namespace_digest_covers_every_field_and_keys_are_blake2b_chains() -> None:
    said = ("a namespace digest (SHA-256 of every `Namespace` field: model, KV dtype, block size, layout, key scheme, "
            "`extra`, and the TP and PP rank and size)")
    assert said in _flat(STORAGE)
    body = json.dumps(asdict(NS), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert NS.digest == hashlib.sha256(b"ucm-db/namespace\0" + body.encode()).digest()
    changes = {"model": "x", "kv_dtype": "float16", "block_size": 8, "layout": "L", "key_scheme": 2, "extra": "q",
               "tp_rank": 1, "tp_size": 2, "pp_rank": 1, "pp_size": 2}
    assert set(changes) == set(asdict(NS))  # every field is in the table
    for name, value in changes.items():
        other = replace(NS, **({name: value} if not name.endswith("_rank") else {name: value, name.replace("rank", "size"): 2}))
        assert other.digest != NS.digest and other.block_keys(list(range(8)))[0] != KEYS[0], name
    tokens = b"".join(i.to_bytes(4, "little") for i in range(4, 8))
    assert KEYS[1] == hashlib.blake2b(KEYS[0] + tokens, digest_size=32).digest()  # "BLAKE2b chains over token ids"


# -- storage.md: durability files, fence, prefault, format -------------------------------------------------
def test_a_group_store_keeps_the_documented_files_private(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", capacity_bytes=64 << 20, durability="group") as store:
        store.put(NS, KEYS, DATA)
        store.flush()
        records = list((tmp_path / "s" / "lmdb").glob(f"synced-snapshot.{os.getpid()}.*"))
        assert len(records) == 1 and records[0].name.count(".") == 2  # `lmdb/synced-snapshot.<pid>.<token>`
    assert "`lmdb/synced-snapshot.<pid>.<token>`" in STORAGE and "`lmdb/walked-clean`" in STORAGE
    assert (tmp_path / "s" / "lmdb" / "walked-clean").is_file()
    # "a process that does not commit (a router reading the feed ...) pins nothing": no record of its own.
    assert "a process that does not commit (a router reading the feed, a vLLM process between saves) pins nothing" in _flat(STORAGE)
    reader = (f"import os, ucm_db\nns = ucm_db.Namespace(model='audit/storage', kv_dtype='bfloat16', block_size=4)\n"
              f"with ucm_db.open({str(tmp_path / 's')!r}, durability='group') as store:\n"
              f"    assert store.lookup(ns, ns.block_keys(list(range(40)))) == 10\n"
              f"    store.changes_since(store.feed_position())\n    print(os.getpid())\n")
    pid = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert pid and not list((tmp_path / "s" / "lmdb").glob(f"synced-snapshot.{pid}.*"))
    # trust.md: "ucm-db creates it 0700, its files 0600"
    assert "(ucm-db creates it 0700, its files 0600)" in _flat(TRUST)
    modes = {p.relative_to(tmp_path): stat.S_IMODE(p.stat().st_mode) for p in [tmp_path / "s", *(tmp_path / "s").rglob("*")]}
    wrong = {p: oct(m) for p, m in modes.items() if m != (0o700 if (tmp_path / p).is_dir() else 0o600)}
    assert not wrong, wrong


def test_the_lmdb_fence_prefault_and_format_are_as_documented() -> None:
    from ucm_db.codec.native import NATIVE_AVAILABLE
    from ucm_db.engines.lmdb import fence, prefault
    from ucm_db.format.names import STORE_FORMAT_VERSION

    flat = _flat(STORAGE)
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'"{fence.LMDB_REQUIREMENT}"' in pyproject and f"`{fence.LMDB_REQUIREMENT}`" in flat
    assert f"`pip install '{fence.LMDB_REQUIREMENT}'`" in flat and f"`{fence.UNPROVEN_LIBRARY_ENV}=1`" in flat
    assert fence.PROVEN_LIBRARY_VERSIONS == {(0, 9, 36)} and fence.PROVEN_DATA_VERSIONS == {1}
    assert "bundling LMDB 0.9.36, whose data files carry data version 1" in flat
    assert "at most 32 GiB of file, 64 MiB of page tables" in flat and f"`{prefault.PREFAULT_ENV}=0` turns it off" in flat
    assert prefault.MAX_POPULATED_BYTES == 32 << 30 and prefault.MAX_POPULATED_BYTES // 4096 * 8 == 64 << 20
    assert prefault.MADV_POPULATE_READ == 22  # "`MADV_POPULATE_READ`, Linux 5.14+"
    assert "The header lives in its own table (store format 3)" in flat and STORE_FORMAT_VERSION == 3
    assert "The test suite insists on the compiled one" in flat and NATIVE_AVAILABLE


def test_a_read_only_rocksdb_open_writes_nothing_and_leaves_no_temp_directory(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    with ucm_db.open(tmp_path / "r", engine="rocksdb", capacity_bytes=64 << 20) as store:
        store.put(NS, KEYS, DATA)

    def files() -> dict[str, tuple[int, int]]:
        return {str(p.relative_to(tmp_path / "r")): (p.stat().st_mtime_ns, p.stat().st_size) for p in (tmp_path / "r").rglob("*")}

    before = files()
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    with ucm_db.open(tmp_path / "r", read_only=True) as store:
        assert [bytes(b) for b in store.get(NS, KEYS) if b is not None] == DATA
        assert [p.name.startswith("ucm-db-rocksdb-ro-") for p in temp.iterdir()] == [True]
    assert files() == before and list(temp.iterdir()) == []
    assert "(`ucm-db-rocksdb-ro-*`, safe to remove)" in _flat(STORAGE)
    # "With no writable temp directory, a read-only open is a `TierError` that says to set `TMPDIR`":
    # tempfile's own override names a directory that does not exist (root writes everywhere else).
    assert "a read-only open is a `TierError` that says to set `TMPDIR`" in _flat(STORAGE)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-dir"))
    with pytest.raises(ucm_db.TierError) as info:
        ucm_db.open(tmp_path / "r", read_only=True)
    assert "TMPDIR" in info.value.hint and files() == before


# -- trust.md: key files ---------------------------------------------------------------------------------------
#: (what the key file holds, its mode, a fragment of the refusal or None where it is taken).
KEY_FILES = [
    (f"# fleet key\n{'ab' * 32}\n", 0o600, None),
    (f"{'ab' * 64}  # the longest\n{'cd' * 32}\n", 0o640, None),  # "640 for a service group"
    (f"{'ab' * 31}\n", 0o600, "32"),
    (f"{'ab' * 65}\n", 0o600, "64"),
    ("not-hex-at-all\n", 0o600, "not hex"),
    (f"{'ab' * 32}\n", 0o604, "readable by everyone"),
    (f"{'ab' * 32}\n", 0o620, "writable by others"),
]


def test_key_files_follow_the_documented_rules(tmp_path: Path) -> None:
    from ucm_db.auth import MAX_KEY_BYTES, MIN_KEY_BYTES, read_key_file

    flat = _flat(TRUST)
    assert "One hex key of 32 to 64 bytes per line" in flat and (MIN_KEY_BYTES, MAX_KEY_BYTES) == (32, 64)
    assert "`#` comments allowed; the file must not be readable by everyone nor writable by others (`chmod 600`, or 640" in flat
    wrong = []
    for i, (text, mode, fragment) in enumerate(KEY_FILES):
        path = tmp_path / f"k{i}"
        path.write_text(text)
        path.chmod(mode)
        try:
            keys = read_key_file(path)
        except ConfigError as exc:
            if fragment is None or fragment not in str(exc) or not exc.hint:
                wrong.append((text[:20], oct(mode), str(exc)))
        else:
            if fragment is not None or not keys.keys:
                wrong.append((text[:20], oct(mode), "taken"))
    assert not wrong, wrong
    # A bad file is a ConfigError at open.
    with pytest.raises(ConfigError, match="readable by everyone"):
        ucm_db.open(tmp_path / "s", remote=f"file://{tmp_path}/remote", remote_auth_key_file=str(tmp_path / "k5"))


# -- trust.md: keyed and encrypted remotes ------------------------------------------------------------------------
def _put(path: Path, remote: Path, **options: object) -> None:
    with ucm_db.open(path, capacity_bytes=64 << 20, remote=f"file://{remote}", remote_mode="write_through", **options) as store:
        store.put(NS, KEYS, DATA)


def _read(path: Path, remote: Path, **options: object) -> tuple[list[bytes | None], dict[str, int]]:
    with ucm_db.open(path, capacity_bytes=64 << 20, remote=f"file://{remote}", remote_deadline_s=10, **options) as store:
        return [None if b is None else bytes(b) for b in store.get(NS, KEYS)], store.stats().remote


def _key(tmp_path: Path, name: str, key: bytes) -> str:
    path = tmp_path / name
    path.write_text(key.hex() + "\n")
    path.chmod(0o600)
    return str(path)


def test_a_keyed_remote_signs_and_a_keyless_node_is_refused_while_its_marker_is_there(tmp_path: Path) -> None:
    """trust.md: a read serves only objects a configured key signed (others
    counted ``unauthenticated`` / ``mac_mismatch``); a keyless open of a
    remote holding ``auth.json`` is refused; a node without a key (the
    marker deleted) reads signed objects, ignoring the MAC."""
    from ucm_db.remote.keying import ENCRYPTED_RECORD_PREFIX, RECORD_PREFIX
    from ucm_db.remote.manifests import ENCRYPTED_MARKER_NAME, KEYED_MARKER_NAME

    assert (KEYED_MARKER_NAME, ENCRYPTED_MARKER_NAME) == ("auth.json", "encryption.json")
    assert (RECORD_PREFIX, ENCRYPTED_RECORD_PREFIX) == (b"remote-keyed:", b"remote-encrypted:")
    flat = _flat(TRUST)
    assert all(f"`{word}`" in flat for word in ("remote-encrypted:<remote id>", "remote-keyed:", "ROOT/encryption.json", "auth.json"))
    remote = tmp_path / "remote"
    remote.mkdir()
    key_a, key_b = _key(tmp_path, "a.key", b"\x01" * 32), _key(tmp_path, "b.key", b"\x02" * 32)
    _put(tmp_path / "writer", remote, remote_auth_key_file=key_a)
    got, counts = _read(tmp_path / "reader-a", remote, remote_auth_key_file=key_a)
    assert got == DATA and counts["unauthenticated"] == counts["mac_mismatch"] == counts["corrupt"] == 0
    got, counts = _read(tmp_path / "reader-b", remote, remote_auth_key_file=key_b)
    assert got == [None] * 10 and counts["mac_mismatch"] >= 1 and counts["corrupt"] == 0  # "signed by another key"
    with pytest.raises(ConfigError, match="is keyed"):
        _read(tmp_path / "keyless", remote)
    (remote / KEYED_MARKER_NAME).unlink()
    with pytest.raises(ConfigError, match="keyed"):  # "or its store recorded the remote as keyed (`remote-keyed:`)"
        _read(tmp_path / "writer", remote)
    got, counts = _read(tmp_path / "keyless-unmarked", remote)
    assert got == DATA  # "Where the marker was deleted it reads signed objects, ignoring the MAC"
    assert "A node without a key is refused at open where the remote's root holds `auth.json`" in flat


def test_an_encrypted_remote_is_a_miss_without_its_key(tmp_path: Path) -> None:
    """trust.md, Encryption: a keyless node is refused while
    ``encryption.json`` is there, and serves no ciphertext when it is not
    (``undecryptable``); a reader with the key serves every block."""
    pytest.importorskip("cryptography")  # the `remote` extra
    from ucm_db.remote.manifests import ENCRYPTED_MARKER_NAME

    remote = tmp_path / "remote"
    remote.mkdir()
    key = _key(tmp_path, "e.key", b"\x03" * 32)
    _put(tmp_path / "writer", remote, remote_encryption_key_file=key)
    assert json.loads((remote / ENCRYPTED_MARKER_NAME).read_text())  # "key ids only"
    assert (b"\x03" * 32).hex() not in (remote / ENCRYPTED_MARKER_NAME).read_text()
    got, counts = _read(tmp_path / "reader", remote, remote_encryption_key_file=key)
    assert got == DATA and counts["undecryptable"] == counts["unencrypted"] == 0
    with pytest.raises(ConfigError):
        _read(tmp_path / "keyless", remote)
    (remote / ENCRYPTED_MARKER_NAME).unlink()
    got, counts = _read(tmp_path / "keyless-unmarked", remote)
    assert got == [None] * 10 and counts["undecryptable"] >= 1 and counts["corrupt"] == 0
    with pytest.raises(ConfigError, match="remote_encryption_key"):  # the store recorded it: a keyless reopen is refused
        _read(tmp_path / "writer", remote)


# -- every `ucm-db ...` the six documents name ---------------------------------------------------------------
def test_every_command_benchmark_and_flag_the_deeper_documents_name_exists() -> None:
    import click
    from click.testing import CliRunner

    from ucm_db.tools.cli import cli
    from ucm_db.tools.cli_bench import bench_group

    def options(command: click.Command) -> set[str]:
        found = {o for p in command.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))}
        if found == {"args"}:  # a command that hands its arguments on (proxy): the flags its help lists
            found = set(re.findall(r"--[\w-]+", CliRunner().invoke(cli, [command.name or "", "--help"]).stdout))
        return found

    docs = ("storage", "trust", "events", "fleet", "tp", "connector")
    text = " ".join(_flat((ROOT / "docs" / f"{name}.md").read_text(encoding="utf-8")) for name in docs)
    mentions = re.findall(r"`ucm-db ([^`]+)`", text)
    # trust.md: "`ucm-db warm` takes the same `--auth-key-file`" and "the same `--encryption-key-file` / `--encryption-key-env`"
    mentions += ["warm --auth-key-file --encryption-key-file --encryption-key-env"]
    wrong, checked = [], 0
    for mention in mentions:
        words = mention.split()
        for name in words[0].split("/"):
            if name == "bench":
                command = bench_group.get_command(click.Context(bench_group), words[1])
            else:
                command = cli.commands.get(name)
                if command is None and name == "connector":  # the start-up line's prefix, not a command
                    continue
            if command is None:
                wrong.append((mention, "no such command"))
                continue
            flags = {f for word in words for f in re.findall(r"--[\w-]+", word)}
            checked += 1
            if flags - options(command):
                wrong.append((mention, flags - options(command)))
    assert checked >= 30 and not wrong, wrong


#: (the archive, the key given at import, a fragment of the refusal or None: imported) per trust.md's "Archives".
ARCHIVE_CASES = [
    ("signed.tar", None, None),  # "Without a key, import trusts the archive's checksums only"
    ("plain.tar", "--auth-key-file a", "carries no MAC"),  # "refuses an archive without a valid manifest MAC"
    ("signed.tar", "--auth-key-file b", "not made by any given auth key"),
    ("sealed.tar", None, "no encryption key was given"),  # "Import without a key refuses an encrypted archive"
    ("plain.tar", "--encryption-key-file a", "is not encrypted"),  # "with a key refuses a plain one"
    ("sealed.tar", "--encryption-key-file b", "which no given encryption key has"),  # "or one ... under a key id it lacks"
    ("sealed.tar", "--encryption-key-file a", None),
]


def test_archive_keys_refuse_as_trust_md_says_and_pins_stay_local(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")  # the `remote` extra: encrypted archives
    from click.testing import CliRunner

    from ucm_db.tools.cli import cli

    def run(*args: object) -> tuple[int, str]:
        result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
        return result.exit_code, result.stderr

    with ucm_db.open(tmp_path / "s", capacity_bytes=64 << 20) as store:
        store.put(NS, KEYS, DATA)
        store.pin(NS, KEYS[:3])
    keys = {"a": _key(tmp_path, "a.key", b"\x0a" * 32), "b": _key(tmp_path, "b.key", b"\x0b" * 32)}
    assert run("export", tmp_path / "s", tmp_path / "signed.tar", "--auth-key-file", keys["a"])[0] == 0
    assert run("export", tmp_path / "s", tmp_path / "plain.tar")[0] == 0
    assert run("export", tmp_path / "s", tmp_path / "sealed.tar", "--encryption-key-file", keys["a"])[0] == 0
    wrong = []
    for i, (archive, key, fragment) in enumerate(ARCHIVE_CASES):
        flags = [key.split()[0], keys[key.split()[1]]] if key else []
        code, stderr = run("import", tmp_path / archive, tmp_path / f"i{i}", *flags)
        if fragment is None:
            with ucm_db.open(tmp_path / f"i{i}") as store:
                ok = code == 0 and store.lookup(NS, KEYS) == 10 and store.stats().pinned_bytes == 0  # "Pins are local"
        else:
            ok = code == 2 and fragment in stderr and not (tmp_path / f"i{i}").exists()  # "(exit 2, nothing written)"
        if not ok:
            wrong.append((archive, key, code, stderr))
    assert not wrong, wrong


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_file_and_link_the_deeper_documents_name_exists() -> None:
    """A code or test path in backquotes (a bare test file name: one beside
    the test named before it, under tests/), and every link with its anchor."""
    wrong = []
    for name in ("storage", "trust", "events", "fleet", "tp", "connector"):
        text = (ROOT / "docs" / f"{name}.md").read_text(encoding="utf-8")
        for path in re.findall(r"`([\w./-]+\.(?:py|c))`", text):
            if not (ROOT / path).exists() and not list((ROOT / "tests").rglob(Path(path).name)):
                wrong.append((name, path))
        for target, anchor in re.findall(r"\]\(([\w.-]+\.md)(?:#([\w-]+))?\)", text):
            linked = ROOT / "docs" / target
            if not linked.exists():
                wrong.append((name, target))
            elif anchor and anchor not in {_slug(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), flags=re.M)}:
                wrong.append((name, f"{target}#{anchor}"))
    assert not wrong, wrong


def test_the_formats_and_key_derivations_trust_md_names() -> None:
    """Signed objects are format 2, encrypted ones format 3, an encrypted
    archive version 3; each MAC and each sealed object names an 8-byte key
    id; the AES key is HKDF-SHA256 of the file's key, never its bytes, and
    one file used for both settings gives unrelated MAC and AES keys."""
    pytest.importorskip("cryptography")  # the `remote` extra
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    from ucm_db.auth import KEY_ID_BYTES, key_id
    from ucm_db.maintenance.archive.sealed import SEALED_ARCHIVE_VERSION
    from ucm_db.remote import sealing
    from ucm_db.remote.envelope import SEALED_FORMAT_VERSION, SIGNED_FORMAT_VERSION

    flat = _flat(TRUST)
    assert "an older ucm-db reads a signed object (format 2) as corrupt" in flat and SIGNED_FORMAT_VERSION == 2
    assert "**Remote objects** are of format version 3" in flat and SEALED_FORMAT_VERSION == 3
    assert "**Archives** exported with a key are of version 3" in flat and SEALED_ARCHIVE_VERSION == 3
    assert "each object names its key's 8-byte id" in flat and KEY_ID_BYTES == 8
    file_key = bytes(range(32))
    aes = sealing.derive_aes_key(file_key)
    reference = HKDF(algorithm=hashes.SHA256(), length=32, salt=sealing._HKDF_SALT, info=sealing._HKDF_INFO).derive(file_key)
    assert aes == reference and aes != file_key  # RFC 5869, checked against cryptography's own HKDF
    assert len({aes, file_key, key_id(file_key), sealing.seal_key_id(file_key)}) == 4
