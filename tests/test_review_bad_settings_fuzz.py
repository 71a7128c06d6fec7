"""Seeded fuzz of bad settings through every door ucm-db reads them from.

Each seed builds a real store (LMDB or RocksDB; random recorded codec, durability, zstd level) of four blocks, then
feeds mutated settings through one door: ``ucm_db.open``; a YAML/JSON file (``load_config_file``, then ``open``) or
a broken one; the documented environment variables; ``ConnectorSettings.from_extra_config`` (inline or
``config_file``), then ``open`` with its store options; a ``ucm-db`` flag or path (CliRunner; a child process for
three seeds). Mutations: wrong types, negative, zero, huge, NaN/inf, blank strings, unknown and misspelled keys,
unknown enum values, conflicts with the recorded settings, bad paths.

Invariants: a call succeeds, or raises a ``UcmDbError`` naming the setting (the file, the path) with a hint, and
nothing else leaks; a value the docs (configuration.md, connector.md, cli.md) rule out is refused, one in range is
taken and reads back as the docs say; the store keeps its recorded settings, top-level files and blocks' bytes, and
nothing lands in the cwd; the CLI exits 0/1/2 as documented, one error line, no traceback. The tests at the end
hold the defects it found, fixed (their inputs are kept out of the fuzz pools).
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml
from click.testing import CliRunner

import ucm_db
from ucm_db import ConfigError, Namespace, StoreConfig, TierError, UcmDbError
from ucm_db.connector.settings import ConnectorSettings
from ucm_db.tools.cli import cli

NS = Namespace(model="fuzz/settings", kv_dtype="bfloat16", block_size=4)
MIB = 1 << 20
SEEDS = list(range(50))
DOORS = ("open", "file", "env", "connector", "cli")
#: Seeds whose first CLI round runs the real entry point in a child process (slow); the rest use CliRunner.
SUBPROCESS_SEEDS = {9, 29, 49}
#: Mutations fed to each seed's store, each through the seed's door, before the store is checked.
ROUNDS = 6
PERSISTED = ("capacity_bytes", "codec", "zstd_level", "durability", "engine")
STORE_KEYS = StoreConfig.field_names()
CONNECTOR_KEYS = tuple(name for name in ConnectorSettings.__dataclass_fields__ if name not in ("path", "store_options"))
#: The documented choices of each enumerated setting.
ENUMS = {"codec": ("zstd", "none"), "durability": ("sync", "group"), "engine": ("lmdb", "rocksdb", "memory"),
         "remote_mode": ("write_back", "write_through"), "remote_codec": ("same", "none", "zstd", "auto"),
         "check_on_open": ("pages", "none"), "load_mode": ("block", "layer", "async"), "publish": ("local", "remote"),
         "publish_codec": ("none", "zstd", "store"), "load_policy": ("auto", "always"),
         "remote_lookup": ("inline", "background")}
#: The documented integer ranges (None: no upper bound documented).
INTS: dict[str, tuple[int, int | None]] = {
    "capacity_bytes": (MIB, 1 << 62), "zstd_level": (-7, 22), "max_readers": (8, 1 << 16), "load_threads": (1, 64),
    "map_size_bytes": (MIB, 1 << 46), "encode_threads": (0, None), "sync_bytes": (1, None), "admit_after": (1, 255),
    "upload_concurrency": (1, None), "remote_read_concurrency": (1, None), "max_pinned_bytes": (0, None),
    "remote_max_object_bytes": (MIB, None), "max_pending_save_bytes": (MIB, None)}
#: The documented ranges of seconds: (low, high, low included).
FLOATS = {"sync_interval_s": (0.001, 3600.0, True), "remote_deadline_s": (0.0, 3600.0, False),
          "load_deadline_s": (0.0, 600.0, True)}
BOOLS = ("read_only", "save_decode", "store_foreign_loads", "save_process")
NULLABLE = {"map_size_bytes", "max_pinned_bytes", "model_id", "remote", "remote_lookup_max_bytes",
            "remote_auth_key_file", "remote_auth_key_env", "remote_encryption_key_file", "remote_encryption_key_env"}
WITH_AUTO = ("admit_after", "save_process", "load_threads")
WRONG_VALUES: tuple[Any, ...] = ("64", "", "   ", 1.5, None, [1], {"a": 1}, b"x", True, -1, 0, 2**70, -(2**70),
                                 float("nan"), float("inf"))
#: Files a store directory gains by a documented use (a remote's uploader election: docs/remote.md).
DOCUMENTED_FILES = {"uploader.lock"}
BROKEN_FILES = {"empty.yaml": b"", "store.toml": b"[store]\ncapacity_bytes = 5\n", "latin1.yaml": b"codec: \xe9\n",
                "list.yaml": b"- codec\n", "intkey.yaml": b"1: 2\n", "alias.yaml": b"a: &x 1\nb: *x\n",
                "deep.yaml": b"k: " + b"[" * 40 + b"]" * 40, "bad.json": b'{"codec": "zstd",}'}


@dataclass(frozen=True)
class StoreFacts:
    """A seed's store: where, what it was created with, its blocks and top-level names."""

    path: Path
    recorded: dict[str, Any]
    keys: list[bytes]
    blocks: list[bytes]
    top_level: list[str]


#: One setting fed through a door; ``verdict``: 'good' (must be taken), 'bad' (must be refused) or 'either'.
Mutation = NamedTuple("Mutation", [("key", Any), ("value", Any), ("verdict", str)])


def make_store(root: Path, rng: random.Random) -> StoreFacts:
    recorded = {"engine": rng.choice(("lmdb", "lmdb", "rocksdb")), "codec": rng.choice(ENUMS["codec"]),
                "durability": rng.choice(ENUMS["durability"]), "capacity_bytes": 64 * MIB,
                "zstd_level": rng.choice((1, 3))}
    path, keys = root / "store", list(NS.block_keys(list(range(16))))
    blocks = [rng.randbytes(256) + bytes(256) for _ in keys]
    with ucm_db.open(path, **recorded) as store:
        store.put(NS, keys, blocks, parent=None)
    return StoreFacts(path, recorded, keys, blocks, sorted(os.listdir(path)))


def verdict(key: str, value: Any, facts: StoreFacts, valid_keys: tuple[str, ...]) -> str:
    """What the docs say of ``key: value`` on this store (a model written from the docs, not from the code)."""
    if key not in valid_keys:
        return "bad"
    if value is None and key in NULLABLE or key in WITH_AUTO and value == "auto":
        return "good"
    whole = isinstance(value, int) and not isinstance(value, bool)
    if key in ENUMS:
        taken = "good" if isinstance(value, str) and value in ENUMS[key] else "bad"
    elif key in INTS:
        low, high = INTS[key]
        taken = "bad" if not whole or value < low or (high is not None and value > high) else "good"
        taken = "either" if taken == "good" and high is None and value > 1 << 62 else taken
    elif key in FLOATS:
        start, end, closed = FLOATS[key]
        number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(float(value))
        taken = "good" if number and (value >= start if closed else value > start) and value <= end else "bad"
    elif key in BOOLS:
        taken = "good" if isinstance(value, bool) else "bad"
    elif key == "model_id":
        taken = "bad" if not isinstance(value, str) or not value else "either" if not value.strip() else "good"
    elif key == "remote":
        taken = "good" if isinstance(value, str) and value.startswith("memory://fuzz") else "bad"
    elif key == "remote_options":
        taken = "good" if isinstance(value, Mapping) else "bad"
    elif key == "remote_lookup_max_bytes":
        taken = "good" if whole and value >= 256 * MIB else "bad"
    else:  # the key settings need a remote, which no mutation sets beside them
        taken = "bad"
    return "bad" if taken == "good" and key in PERSISTED and value != facts.recorded[key] else taken


def candidate_values(key: str, facts: StoreFacts) -> list[Any]:
    """The values of ``key`` near its documented edges, its choices, its recorded value."""
    values: list[Any] = [facts.recorded[key]] * 4 if key in PERSISTED else []
    if key in ENUMS:
        first = ENUMS[key][0]
        values += [*ENUMS[key], *ENUMS[key], first.upper(), f" {first}", f"{first} ", "gzip"]
    if key in INTS:
        low, high = INTS[key]
        values += [low, low, low - 1, float(low), str(low)] + ([high, high + 1] if high is not None else [])
    if key in FLOATS:
        start, end, _ = FLOATS[key]
        values += [max(start, 0.5), end, end * 2, -0.5, str(end)]
    if key in BOOLS:
        values += [True, False, 1, "true", "auto"]
    special: dict[str, list[Any]] = {
        "remote": [f"memory://fuzz-{facts.path.parent.name}"] * 3 + ["nosuch://x", "s3", "memory:/x"],
        "remote_options": [{}, {"endpoint_url": "http://127.0.0.1:9"}, [["a", 1]]], "model_id": ["org/model"] * 2}
    return values + special.get(key, [])


def draw_mutation(rng: random.Random, facts: StoreFacts, valid: tuple[str, ...], pool: tuple[str, ...]) -> Mutation:
    key = rng.choice(pool)
    if rng.random() < 0.15:  # a misspelled or unknown key, with a value its right spelling takes
        spellings = [key[:-1], key.upper(), key + " ", " " + key, key.replace("_", "-"), key + "s", "nonsense_opt"]
        return Mutation(rng.choice([s for s in spellings if s not in valid]), facts.recorded.get(key, 1), "bad")
    value = rng.choice(WRONG_VALUES if rng.random() < 0.3 else candidate_values(key, facts) or WRONG_VALUES)
    return Mutation(key, value, verdict(key, value, facts, valid))


def assert_refusal(exc: BaseException, needle: str, what: Any) -> None:
    assert isinstance(exc, UcmDbError), f"{what}: {type(exc).__name__} leaked: {exc}"
    assert needle in exc.message, f"{what}: the message does not name {needle!r}: {exc.message}"
    assert exc.hint.strip(), f"{what}: no hint: {exc}"


def open_with(path: Path, options: Mapping[str, Any], mutation: Mutation, needle: str) -> None:
    """``ucm_db.open(path, **options)`` judged by ``mutation.verdict``; a taken store option reads back as the docs
    say it means."""
    try:
        store = ucm_db.open(path, **options)
    except Exception as exc:  # noqa: BLE001 - what leaks is the finding
        assert mutation.verdict != "good", f"{mutation}: a documented value was refused: {exc!r}"
        assert_refusal(exc, needle, mutation)
        return
    with store:
        assert mutation.verdict != "bad", f"{mutation}: a value the docs rule out was taken"
        stats, key, value = store.stats(), mutation.key, mutation.value
        if key == "max_pinned_bytes":
            limit = stats.capacity_bytes // 2 if value is None else min(value, stats.capacity_bytes)
            assert stats.max_pinned_bytes == limit
        elif key == "remote_options":
            assert stats.settings[key] == {name: "***" for name in value}  # shown redacted
        elif key in STORE_KEYS:
            assert repr(stats.settings[key]) == repr(value), (key, stats.settings[key], value)
        if key == "read_only" and value:
            with pytest.raises(TierError):
                store.put(NS, NS.block_keys(list(range(100, 104))), [bytes(64)], parent=None)


def assert_intact(facts: StoreFacts, cwd: Path) -> None:
    """The store holds what it held, as it was created, with the same files; nothing landed in the cwd."""
    names = set(os.listdir(facts.path))
    assert names >= set(facts.top_level) and names - set(facts.top_level) <= DOCUMENTED_FILES, names
    assert not list(cwd.iterdir()), f"files appeared in the current directory: {list(cwd.iterdir())}"
    with ucm_db.open(facts.path) as store:
        assert [None if b is None else bytes(b) for b in store.get(NS, facts.keys)] == facts.blocks
        settings = store.stats().settings
    assert {name: settings[name] for name in PERSISTED} == facts.recorded


# -- doors ------------------------------------------------------------------------------------------------------

def write_config(tmp: Path, options: dict[str, Any], rng: random.Random) -> Path:
    as_json = rng.random() < 0.5 and not any(isinstance(v, bytes) for v in options.values())
    path = tmp / ("settings.json" if as_json else "settings.yaml")
    path.write_text(json.dumps(options) if as_json else yaml.safe_dump(options), encoding="utf-8")
    return path


def door_file(facts: StoreFacts, rng: random.Random, tmp: Path) -> None:
    if rng.random() < 0.3:  # the file itself is at fault: refused naming it, by both readers
        broken = tmp / rng.choice([*BROKEN_FILES, "missing.yaml", "directory", "fifo.yaml"])
        if broken.name in BROKEN_FILES:
            broken.write_bytes(BROKEN_FILES[broken.name])
        elif broken.name != "missing.yaml":
            broken.mkdir() if broken.name == "directory" else os.mkfifo(broken)  # a FIFO: refused, never read
        for config in ({"config_file": str(broken)}, None):  # the connector's config_file, load_config_file
            with pytest.raises(Exception) as caught:
                ConnectorSettings.from_extra_config(config) if config else ucm_db.load_config_file(broken)
            assert_refusal(caught.value, str(broken), broken.name)
        return
    m = draw_mutation(rng, facts, STORE_KEYS, STORE_KEYS)
    loaded = ucm_db.load_config_file(write_config(tmp, {m.key: m.value}, rng))
    assert list(loaded) == [m.key] and repr(loaded[m.key]) == repr(m.value), (m, loaded)  # repr: NaN-safe
    open_with(facts.path, loaded, m, m.key.strip())


def door_connector(facts: StoreFacts, rng: random.Random, tmp: Path) -> None:
    m = draw_mutation(rng, facts, STORE_KEYS + CONNECTOR_KEYS + ("path",), STORE_KEYS + CONNECTOR_KEYS + ("path",) * 4)
    if m.key == "path":
        m = Mutation("path", *rng.choice([(str(tmp / "a-file"), "bad"), ("", "bad"), (5, "bad"), ("a\0b", "bad"),
                                          (str(facts.path / facts.recorded["engine"] / "sub"), "bad"),
                                          ("~no_such_user_fz/x", "bad"), (f"{facts.path}/", "good"),
                                          (str(tmp / "new" / "s"), "good")]))
    extra: dict[str, Any] = {"path": str(facts.path), m.key: m.value}
    if rng.random() < 0.3 and m.key != "path" and not isinstance(m.value, bytes):
        extra = {"path": str(facts.path), "config_file": str(write_config(tmp, {m.key: m.value}, rng))}
    try:
        settings = ConnectorSettings.from_extra_config(extra)
    except Exception as exc:  # noqa: BLE001
        assert m.verdict != "good", f"{m}: a documented value was refused: {exc!r}"
        assert_refusal(exc, m.key.strip(), m)
        return
    parsed = getattr(settings, m.key) if m.key in CONNECTOR_KEYS else settings.store_options.get(m.key, m.value)
    assert repr(parsed) == repr(m.value) and not (m.key in CONNECTOR_KEYS and m.verdict == "bad"), (m, parsed)
    open_with(settings.path, settings.store_options, m, "path" if m.key == "path" else m.key)


def door_env(facts: StoreFacts, rng: random.Random, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ("UCM_DB_PREFAULT", "UCM_DB_BATCH_LOADS", "UCM_DB_INLINE_READS", "UCM_DB_ALLOW_UNPROVEN_LMDB")
    monkeypatch.setenv(rng.choice(flags), rng.choice(("0", "1", "", " 0 ", "yes", "-1", str(2**70))))
    monkeypatch.setenv("HOME", str(facts.path.parent))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp / "xdg"))
    case, value, expected = rng.choice([
        ("store", str(facts.path), facts.path), ("tilde", "~/store", facts.path),
        ("slash", f"{facts.path}/", facts.path), ("empty", "", tmp / "xdg" / "ucm-db"),
        ("new", str(tmp / "fresh" / "s"), tmp / "fresh" / "s"), ("file", str(tmp / "a-file"), None),
        ("inside", str(facts.path / facts.recorded["engine"] / "x"), None)])
    monkeypatch.setenv("UCM_DB_PATH", value)
    settings = ConnectorSettings.from_extra_config({})
    assert settings.path == (Path(value).expanduser() if value else expected), (case, settings.path)
    try:
        store = ucm_db.open(settings.path, **settings.store_options)
    except Exception as exc:  # noqa: BLE001
        assert expected is None, f"UCM_DB_PATH {case}: refused: {exc!r}"
        assert_refusal(exc, "path", case)
        return
    with store:
        assert expected is not None and Path(store.path) == expected.resolve(), (case, store.path)
        got = [None if b is None else bytes(b) for b in store.get(NS, facts.keys)]
        assert got == (facts.blocks if expected == facts.path else [None] * len(facts.keys)), case


def cli_cases(facts: StoreFacts, tmp: Path) -> list[tuple[list[str], set[int]]]:
    """(arguments, documented exit codes): one flag or path each, mutated."""
    path, tokens = str(facts.path), tmp / "prompts.jsonl"
    tokens.write_text(json.dumps(list(range(16))) + "\n")
    pin = ("pin", path, "--namespace", NS.model, "--tokens", str(tokens), "--max-pinned-bytes")
    flags = {("inspect", path, "--top"): {"-1": 2, "0": 0, "3": 0, "x": 2, "": 2, "1.5": 2, str(2**70): 0},
             ("verify", path, "--sample"): {"0": 2, "1": 0, "-3": 2, "nan": 2, str(2**70): 0},
             ("events", path, "--since"): {"0": 0, "-1": 2, "abc": 2, str(2**64): 0},
             pin: {"1GiB": 0, "-5": 2, "nan": 2, "": 2, "1e9": 2, "   ": 2, "5PiB": 2, str(2**70): 2, "0.5": 2, "0": 1},
             ("compact", path, "--target-bytes"): {"1GiB": 0, str(2**70): 0, "x": 2, "-1": 2, "0.5": 2, "": 2}}
    cases = [([*head, value], {code}) for head, values in flags.items() for value, code in values.items()]
    cases += [(["migrate", "--to-engine", engine, path, str(tmp / "converted")], {code}) for engine, code in
              (("leveldb", 2), ("LMDB", 2), (facts.recorded["engine"], 2), ({"lmdb": "rocksdb"}.get(
                  facts.recorded["engine"], "lmdb"), 0))]
    return cases + [(["inspect", p], {2}) for p in (str(tmp / "a-file"), str(tmp / "absent"), "")]


def door_cli(facts: StoreFacts, rng: random.Random, tmp: Path, child: bool, cwd: Path) -> None:
    args, codes = rng.choice(cli_cases(facts, tmp))
    if child:
        done = subprocess.run([sys.executable, "-m", "ucm_db.tools.cli", *args], capture_output=True, text=True,
                              timeout=120, cwd=cwd)
        code, stderr = done.returncode, done.stderr
    else:
        result = CliRunner().invoke(cli, args)
        leaked = None if isinstance(result.exception, SystemExit) else result.exception
        assert leaked is None, f"{args}: {type(leaked).__name__} leaked: {leaked}"
        code, stderr = result.exit_code, result.stderr
    assert "Traceback" not in stderr, f"{args}: traceback:\n{stderr}"
    assert code in codes, f"{args}: exit {code}, documented {codes}\n{stderr}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("ucm-db: error:", "Error:"))]
    assert len(errors) == (code != 0), f"{args}: one error line expected:\n{stderr}"
    if errors and errors[0].startswith("ucm-db: error:"):  # ours: the only line, with the fix; click's: its usage
        assert len(lines) == 1 and "(hint: " in errors[0], f"{args}: {stderr}"
    if args[0] == "migrate" and code == 0:  # the copy holds the same blocks
        with ucm_db.open(args[-1]) as copy:
            assert [bytes(b or b"") for b in copy.get(NS, facts.keys)] == facts.blocks


@pytest.mark.parametrize("seed", SEEDS)
def test_bad_setting_is_refused_clearly_and_loses_nothing(seed: int, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    (cwd := tmp_path / "cwd").mkdir()
    monkeypatch.chdir(cwd)  # a relative path or URL lands here, where assert_intact sees it
    facts = make_store(tmp_path, rng)
    door = DOORS[seed % len(DOORS)]
    for round_number in range(ROUNDS):
        (work := tmp_path / f"round{round_number}").mkdir()
        (work / "a-file").write_text("not a store")  # a path that is a file, for the path mutations
        if door == "env":
            door_env(facts, rng, work, monkeypatch)
        elif door == "cli":
            door_cli(facts, rng, work, seed in SUBPROCESS_SEEDS and round_number == 0, cwd)
        elif door == "open":  # connector keys are unknown options here
            m = draw_mutation(rng, facts, STORE_KEYS, STORE_KEYS + CONNECTOR_KEYS[:3])
            open_with(facts.path, {m.key: m.value}, m, m.key.strip())
        else:
            {"file": door_file, "connector": door_connector}[door](facts, rng, work)
    assert_intact(facts, cwd)


# -- the defects found, fixed ---------------------------------------------------------------------------------

#: An int past Python's 4300-digit str() limit: what ``capacity_bytes: 0x<4200 f's>`` in a YAML file reads as
#: (a hex literal escapes the parser's decimal-digit limit, which load_config_file turns into a ConfigError).
HUGE = 16**4200 - 1
HUGE_REASON = "an int of over 4300 digits: the refusal's f'{value!r}' raises ValueError, not ConfigError"


def yaml_file(tmp: Path, text: str) -> str:
    (tmp / "settings.yaml").write_text(text)
    return str(tmp / "settings.yaml")


def store_at(tmp: Path) -> Path:
    return make_store(tmp, random.Random(0)).path


#: id: (the call, given tmp_path and monkeypatch; what its ConfigError must name; what is wrong now).
LEAKS: dict[str, tuple[Callable[[Path, pytest.MonkeyPatch], Any], str, str]] = {
    "huge_int_open": (lambda t, _: ucm_db.open(store_at(t), capacity_bytes=HUGE), "capacity_bytes", HUGE_REASON),
    "huge_int_yaml_hex": (lambda t, _: ucm_db.open(store_at(t), **ucm_db.load_config_file(
        yaml_file(t, "capacity_bytes: 0x" + "f" * 4200))), "capacity_bytes", HUGE_REASON),
    "huge_int_connector_config_file": (lambda t, _: ConnectorSettings.from_extra_config(
        {"path": str(t), "config_file": yaml_file(t, f"load_deadline_s: {HUGE:#x}")}), "load_deadline_s", HUGE_REASON),
    "ucm_db_path_unknown_user": (lambda t, mp: (mp.setenv("UCM_DB_PATH", "~no_such_user_fz/c"),  # type: ignore
                                                ConnectorSettings.from_extra_config({})), "UCM_DB_PATH",
                                 "default_store_path: UCM_DB_PATH='~nosuchuser/x' leaks pathlib's RuntimeError"),
    "remote_options_int_name": (lambda t, _: ucm_db.open(store_at(t), **ucm_db.load_config_file(yaml_file(
        t, f"remote: memory://fuzz-{t.name}\nremote_options:\n  1: 2\n"))), "remote_options",
        "remote_options with a non-str name (YAML reads 1: as an int) reach fsspec as **kwargs: TypeError"),
    **{f"config_file_path_{name}": (lambda t, _, p=path: ucm_db.load_config_file(p), "config file",  # type: ignore
                                    "load_config_file lets pathlib's ValueError/TypeError out")
       for name, path in (("nul", "settings\0.yaml"), ("bytes", b"settings.yaml"), ("none", None))}}


@pytest.mark.parametrize("call,needle", [
    pytest.param(call, needle, id=name) for name, (call, needle, _was) in LEAKS.items()])
def test_bad_input_is_a_config_error_not_a_leak(call: Callable[[Path, pytest.MonkeyPatch], Any], needle: str,
                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as caught:
        call(tmp_path, monkeypatch)
    assert needle in caught.value.message and caught.value.hint.strip()


def test_cli_size_of_many_digits_exits_2_without_traceback(tmp_path: Path) -> None:
    args = ["compact", str(store_at(tmp_path)), "--target-bytes", "9" * 5000]  # pin and gc parse sizes alike
    done = subprocess.run([sys.executable, "-m", "ucm_db.tools.cli", *args], capture_output=True, text=True, timeout=99)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-300:]


def test_file_url_naming_no_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # today the open succeeds and the put below uploads into tmp_path, the cwd
    with pytest.raises(ConfigError, match="remote"), ucm_db.open(store_at(tmp_path), remote="file://") as store:
        store.put(NS, NS.block_keys(list(range(200, 204))), [bytes(512)], parent=None)
        store.flush()
