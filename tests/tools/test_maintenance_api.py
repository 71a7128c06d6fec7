"""The maintenance API (ucm_db.maintenance) called directly, as scripts do."""

from __future__ import annotations

from pathlib import Path

import pytest

import ucm_db
from ucm_db import maintenance

from cli_stores import NS_A, NS_B, make_store


def test_blocks_and_namespaces_of_a_known_store(tmp_path: Path) -> None:
    chains = make_store(tmp_path / "s")
    blocks = list(maintenance.iter_blocks(tmp_path / "s"))
    assert [b.key for b in blocks] == sorted(k for keys in chains.values() for k in keys)
    by_key = {b.key: b for b in blocks}
    for keys in chains.values():
        assert [by_key[k].parent for k in keys] == [None, *keys[:-1]]
        assert [by_key[k].depth for k in keys] == list(range(len(keys)))
    only_b = list(maintenance.iter_blocks(tmp_path / "s", ("test/beta",)))
    assert [b.key for b in only_b] == sorted(chains["b0"]) and {b.namespace_id for b in only_b} == {NS_B.digest[:16]}
    rows = {r["model"]: r for r in maintenance.namespaces(tmp_path / "s")}
    assert rows["test/alpha"]["blocks"] == 20 and rows["test/beta"]["blocks"] == 3


def test_evict_to_bytes_keeps_whole_prefixes_and_the_capacity(tmp_path: Path) -> None:
    chains = make_store(tmp_path / "s")
    with ucm_db.open(tmp_path / "s") as store:
        store.get(NS_A, chains["a3"])  # a3 becomes the most recently used
        before = store.stats()
    target = before.stored_bytes // 2
    evicted = maintenance.evict_to_bytes(tmp_path / "s", target)
    with ucm_db.open(tmp_path / "s") as store:
        after = store.stats()
        assert after.stored_bytes <= target and after.blocks == before.blocks - evicted > 0
        assert after.evictions == before.evictions + evicted
        assert after.capacity_bytes == before.capacity_bytes  # eviction no longer lowers the capacity
        assert store.lookup(NS_A, chains["a3"]) == 5
        for tag, keys in chains.items():
            n = store.lookup(NS_B if tag == "b0" else NS_A, keys)
            assert store._tier.exists(keys) == [True] * n + [False] * (len(keys) - n)  # whole prefixes only
        assert store._tier.check() == []
    assert maintenance.evict_to_bytes(tmp_path / "s", 0) == after.blocks
    with pytest.raises(ucm_db.ConfigError):
        maintenance.evict_to_bytes(tmp_path / "s", -1)


def test_verify_fix_recounts_damaged_totals(tmp_path: Path) -> None:
    make_store(tmp_path / "s")
    with ucm_db.open(tmp_path / "s") as store:
        good = store.stats()
        store._tier.engine.write(lambda txn: txn.put("info", b"totals", bytes(56)))  # one damaged counter record
    report = maintenance.verify(tmp_path / "s")
    assert report.problems and not report.corrupt and report.checked == 23
    fixed = maintenance.verify(tmp_path / "s", fix=True)
    assert fixed.totals_recomputed and fixed.quarantined_blocks == 0
    assert not maintenance.verify(tmp_path / "s").problems
    with ucm_db.open(tmp_path / "s") as store:
        now = store.stats()
    assert (now.blocks, now.raw_bytes, now.stored_bytes) == (good.blocks, good.raw_bytes, good.stored_bytes)


def test_read_only_operations_refuse_a_missing_store_and_create_nothing(tmp_path: Path) -> None:
    for call in (maintenance.inspect, maintenance.verify, maintenance.namespaces, lambda p: list(maintenance.iter_blocks(p))):
        with pytest.raises(ucm_db.ConfigError) as info:
            call(tmp_path / "none")
        assert info.value.hint
    assert not (tmp_path / "none").exists()


def test_an_isolated_read_survives_a_reader_killed_by_a_signal(tmp_path: Path) -> None:
    """What a damaged LMDB file does to a reader (an abort, a SIGBUS), done
    for real to the child: the caller gets a TierError, not a death."""
    import os
    import signal

    from ucm_db.maintenance.isolation import run_isolated

    for sig in (signal.SIGABRT, signal.SIGBUS):
        with pytest.raises(ucm_db.TierError) as info:
            run_isolated(lambda sig=sig: os.kill(os.getpid(), sig), tmp_path)  # type: ignore[misc]
        assert sig.name in str(info.value) and str(tmp_path) in info.value.hint
    assert run_isolated(lambda: {"blocks": 3, "key": "ab"}, tmp_path) == {"blocks": 3, "key": "ab"}

    def refuse() -> dict[str, object]:
        raise ucm_db.FormatVersionError("store at X has format 1", hint="run `ucm-db migrate X`")

    with pytest.raises(ucm_db.FormatVersionError) as refused:
        run_isolated(refuse, tmp_path)
    assert refused.value.hint == "run `ucm-db migrate X`" and str(refused.value).startswith("store at X has format 1")


def test_an_unexpected_error_in_the_isolated_read_is_named_to_the_caller(tmp_path: Path) -> None:
    """Found by the concurrent-load suite: the CLI's captured stderr lost
    the child's traceback, and the caller said only "exit status 70"."""
    from ucm_db.maintenance.isolation import run_isolated

    def crash() -> dict[str, object]:
        raise KeyError("lost-entry")

    with pytest.raises(ucm_db.TierError) as crashed:
        run_isolated(crash, tmp_path)
    assert "KeyError" in str(crashed.value) and "lost-entry" in str(crashed.value) and "in crash" in str(crashed.value)

    def unencodable() -> dict[str, object]:
        cycle: dict[str, object] = {}
        cycle["self"] = cycle
        return cycle

    with pytest.raises(ucm_db.TierError) as refused:
        run_isolated(unencodable, tmp_path)
    assert "ValueError" in str(refused.value) and "Circular" in str(refused.value)


def test_isolated_inspect_and_verify_match_the_in_process_ones(tmp_path: Path) -> None:
    make_store(tmp_path / "s")
    assert maintenance.inspect(tmp_path / "s", top=2, now_ns=1, isolated=True) == maintenance.inspect(tmp_path / "s", top=2, now_ns=1)
    assert maintenance.verify(tmp_path / "s", isolated=True) == maintenance.verify(tmp_path / "s")


@pytest.mark.parametrize("target_bytes", [-1, True, 0.5, "1"])
def test_compact_refuses_a_target_that_is_no_byte_count_and_evicts_nothing(tmp_path: Path, target_bytes: object) -> None:
    """A script computing ``capacity - needed`` that went negative emptied the store."""
    chains = make_store(tmp_path / "s")
    with pytest.raises(ucm_db.ConfigError, match="target_bytes must be an integer >= 0") as raised:
        maintenance.compact(tmp_path / "s", target_bytes=target_bytes)  # type: ignore[arg-type]
    assert raised.value.hint
    with ucm_db.open(tmp_path / "s") as store:
        assert store.lookup(NS_A, chains["a0"]) == 5 and store.lookup(NS_B, chains["b0"]) == 3


@pytest.mark.parametrize("limits", [{"max_bytes": -1}, {"older_than_s": -3600.0}, {"older_than_s": float("nan")},
                                    {"max_bytes": True}])
def test_remote_gc_refuses_a_negative_or_odd_limit_and_deletes_nothing(tmp_path: Path, limits: dict[str, object]) -> None:
    remote = tmp_path / "remote"
    with ucm_db.open(tmp_path / "s", remote=f"file://{remote}", remote_mode="write_through") as store:
        keys = NS_A.block_keys(list(range(4 * NS_A.block_size)))
        store.put(NS_A, keys, [b"r" * 1024] * 4)
    objects = sorted(p for p in remote.rglob("*") if p.is_file())
    with pytest.raises(ucm_db.ConfigError, match="must be"):
        maintenance.gc_remote(f"file://{remote}", **limits)  # type: ignore[arg-type]
    assert sorted(p for p in remote.rglob("*") if p.is_file()) == objects


@pytest.mark.parametrize("url", ["", "  ", ".", "relative/dir", "file://"])
def test_remote_gc_and_warm_refuse_what_is_no_remote_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """An unset ``$REMOTE`` gave gc the current directory, whose files it removed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ucm_db.ConfigError, match="needs a remote URL"):
        maintenance.gc_remote(url, older_than_s=0)
    with pytest.raises(ucm_db.ConfigError, match="needs a remote URL"):
        maintenance.remote_namespace(url, None, "m")
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_warm_from_a_missing_local_remote_names_the_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ucm_db.ConfigError, match="does not exist"):
        maintenance.remote_namespace(f"file://{tmp_path / 'no-remote'}", None, "m")


@pytest.mark.parametrize(("call", "message"), [
    (lambda path: maintenance.pin(path, "test/alpha", None), "pin takes a list of prompts, got NoneType"),  # type: ignore[arg-type]
    (lambda path: maintenance.unpin(path, "test/alpha", 5), "unpin takes a list of prompts, got int"),  # type: ignore[arg-type]
    (lambda path: maintenance.lookup(path, "test/alpha", "1 2 3"), "lookup takes a list of prompts, got str"),  # type: ignore[arg-type]
    (lambda path: list(maintenance.iter_event_lines(path, (), since_seq=-5)), "since_seq must be an integer >= 0 (or None), got -5"),
    (lambda path: list(maintenance.iter_event_lines(path, (), since_seq="5")), "since_seq must be an integer >= 0 (or None), got '5'"),  # type: ignore[arg-type]
    (lambda path: list(maintenance.iter_events(path, (), since_seq=True)), "since_seq must be an integer >= 0 (or None), got True"),
    (lambda path: maintenance.verify(path, sample=0), "sample must be an integer >= 1 (or None), got 0"),
    (lambda path: maintenance.verify(path, sample=-3), "sample must be an integer >= 1 (or None), got -3"),
    (lambda path: maintenance.verify(path, sample=2.5), "sample must be an integer >= 1 (or None), got 2.5"),  # type: ignore[arg-type]
])
def test_malformed_maintenance_arguments_are_config_errors(tmp_path: Path, call, message: str) -> None:
    """Audit F18: a TypeError, a struct.error, or (``sample=0``) a clean
    report of 0 blocks checked."""
    make_store(tmp_path / "s")
    before = maintenance.inspect(tmp_path / "s")
    with pytest.raises(ucm_db.ConfigError) as raised:
        call(tmp_path / "s")
    assert str(raised.value).startswith(message) and raised.value.hint
    after = maintenance.inspect(tmp_path / "s")
    assert (after["blocks"], after["stored_bytes"], after["pinned_bytes"]) == (before["blocks"], before["stored_bytes"], 0)


@pytest.mark.parametrize("target_bytes", [-1, True, 0.5])
def test_evict_to_bytes_refuses_a_target_that_is_no_byte_count(tmp_path: Path, target_bytes: object) -> None:
    chains = make_store(tmp_path / "s")
    with pytest.raises(ucm_db.ConfigError, match="target_bytes must be an integer >= 0"):
        maintenance.evict_to_bytes(tmp_path / "s", target_bytes)  # type: ignore[arg-type]
    with ucm_db.open(tmp_path / "s") as store:
        assert store.lookup(NS_A, chains["a0"]) == 5
