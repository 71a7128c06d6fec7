"""A store with a remote: write-back and write-through uploads, read-through
lookup/get with promotion, warming, on memory://, a shared directory and S3."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import ucm_db
from ucm_db.errors import ConfigError
from ucm_db.remote.tier import RemoteRoot, unpack_object

from .conftest import Remote, chain

pytestmark = pytest.mark.timeout(60)
CAP = 64 << 20


def _remote_objects(remote: Remote, namespace) -> dict[bytes, bytes]:
    root = RemoteRoot.from_url(remote.url, remote.options)
    tier = root.tier(namespace.digest[:16])
    return {key: root.fs.cat_file(tier.path(key)) for key in tier.iterate()}


def test_write_back_uploads_every_block_and_flush_waits(remote: Remote, tmp_path: Path, namespace) -> None:
    keys, payloads = chain(namespace, 40)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as store:
        store.put(namespace, keys[:25], payloads[:25])
        store.put(namespace, keys[25:], payloads[25:], parent=keys[24])
        store.flush()
        assert store.stats().pending_uploads == 0
    objects = _remote_objects(remote, namespace)
    assert set(objects) == set(keys)
    for i, key in enumerate(keys):
        obj = unpack_object(objects[key], key)
        assert obj.parent == (keys[i - 1] if i else None)
    manifest = RemoteRoot.from_url(remote.url, remote.options).read_manifest(namespace.digest[:16])
    assert manifest is not None and manifest["namespace"] == namespace.to_dict()


def test_second_node_reads_through_and_promotes(remote: Remote, tmp_path: Path, namespace) -> None:
    keys, payloads = chain(namespace, 30)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as node_a:
        node_a.put(namespace, keys[:20], payloads[:20])
        node_a.flush()
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=5.0)) as node_b:
        node_b.put(namespace, keys[:3], payloads[:3])  # B has a short local prefix of its own
        assert node_b.lookup(namespace, keys) == 20
        assert node_b._tier.count_prefix(keys) == 20  # promoted, local from now on
        assert node_b.get(namespace, keys) == [*payloads[:20], *[None] * 10]
        assert node_b._tier.check() == []
        node_b.flush(upload_timeout_s=30)
        assert node_b.stats().remote["uploaded"] == 3  # its own puts; promoted blocks are not re-uploaded


def test_get_reads_through_without_lookup(remote: Remote, tmp_path: Path, namespace) -> None:
    keys, payloads = chain(namespace, 12)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as node_a:
        node_a.put(namespace, keys, payloads)
        node_a.flush()
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=2.0)) as node_b:
        buffers = [bytearray(len(p)) for p in payloads[:6]]
        assert node_b.get_into(namespace, keys[:6], buffers) == [True] * 6
        assert buffers == payloads[:6]
        assert node_b._tier.count_prefix(keys) == 6
        # A suffix whose parent is not local is served but cannot be promoted.
        assert node_b.get(namespace, keys[8:]) == payloads[8:]
        assert node_b._tier.count_prefix(keys) == 6
        assert node_b._tier.check() == []


@pytest.mark.parametrize("batch_bytes", [1, 64 << 20])
def test_get_promotes_in_batches_as_objects_arrive(remote: Remote, tmp_path: Path, namespace, monkeypatch, batch_bytes: int) -> None:
    # One object per local commit (batch_bytes=1) or all in one: the same
    # blocks end up local; a hole on the remote stops promotion there, and
    # what follows it is served but not promoted (its parent is not local).
    import ucm_db.remote.link

    monkeypatch.setattr(ucm_db.remote.link, "PROMOTE_BATCH_BYTES", batch_bytes)
    keys, payloads = chain(namespace, 10)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as node_a:
        node_a.put(namespace, keys, payloads)
        node_a.flush()
    root = RemoteRoot.from_url(remote.url, remote.options)
    root.fs.rm_file(root.tier(namespace.digest[:16]).path(keys[6]))
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=2.0)) as node_b:
        assert node_b.get(namespace, keys) == [*payloads[:6], None, *payloads[7:]]
        assert node_b._tier.count_prefix(keys) == 6
        assert node_b._tier.check() == []


def test_write_through_uploads_before_put_returns(remote: Remote, tmp_path: Path, namespace) -> None:
    keys, payloads = chain(namespace, 8)
    options = remote.store_options(remote_mode="write_through")
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **options) as store:
        store.put(namespace, keys, payloads)
        assert store.stats().pending_uploads == 0
        assert set(_remote_objects(remote, namespace)) == set(keys)


@pytest.mark.parametrize("remote", ["file"], indirect=True)
def test_objects_lie_where_remote_md_says(remote: Remote, tmp_path: Path, namespace) -> None:
    """docs/remote.md: ROOT/<namespace short id>/<key[0] hex>/<key hex>, a manifest.json beside (audit F6:
    the page said the namespace id, 32 hex digits; the tests built paths with the code's own helper)."""
    keys, payloads = chain(namespace, 2)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options(remote_mode="write_through")) as store:
        store.put(namespace, keys, payloads)
    root = Path(remote.url.removeprefix("file://"))
    assert len(namespace.short_id) == 16 and (root / namespace.short_id / "manifest.json").is_file()
    for key in keys:
        assert (root / namespace.short_id / key[:1].hex() / key.hex()).is_file()


def test_warm_reports_local_fetched_missing(remote: Remote, tmp_path: Path, namespace) -> None:
    keys, payloads = chain(namespace, 16, seed=1)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as node_a:
        node_a.put(namespace, keys[:10], payloads[:10])
        node_a.flush()
    ticks: list[tuple[int, int]] = []
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options()) as node_b:
        node_b.put(namespace, keys[:2], payloads[:2])
        report = node_b.warm(namespace, keys=keys, progress=lambda done, total: ticks.append((done, total)))
        assert (report.already_local, report.fetched, report.missing) == (2, 8, 6)
        assert report.bytes > 0 and report.seconds >= 0
        assert ticks[-1] == (16, 16)
        assert node_b._tier.count_prefix(keys) == 10
        again = node_b.warm(namespace, keys=[keys])
        assert (again.already_local, again.fetched, again.missing) == (10, 0, 6)


def test_warm_by_token_sequences(remote: Remote, tmp_path: Path, namespace) -> None:
    tokens = list(range(1000, 1000 + 4 * 9 + 2))  # 9 full blocks and a partial one
    keys = namespace.block_keys(tokens)
    payloads = [bytes([i]) * 2048 for i in range(len(keys))]
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as node_a:
        node_a.put(namespace, keys, payloads)
        node_a.flush()
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options()) as node_b:
        report = node_b.warm(namespace, token_sequences=[tokens, tokens[:8]])
        # each distinct block once: the second prompt's 2 blocks are the first's, fetched by this warm
        assert (report.already_local, report.fetched, report.missing) == (0, 9, 0)
        assert node_b.get(namespace, keys) == payloads


def test_warm_needs_input(tmp_path: Path, namespace) -> None:
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP) as store:
        with pytest.raises(ConfigError):
            store.warm(namespace)
        report = store.warm(namespace, keys=chain(namespace, 3)[0])
        assert (report.already_local, report.fetched, report.missing) == (0, 0, 3)


def test_warm_reads_iterators_of_keys_and_of_chains(remote: Remote, tmp_path: Path, namespace) -> None:
    """docs/api.md: iterators of keys are read, never silently consumed (audit F10: a TypeError before)."""
    keys, payloads = chain(namespace, 6, seed=2)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as node_a:
        node_a.put(namespace, keys, payloads)
        node_a.flush()
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options()) as node_b:
        report = node_b.warm(namespace, keys=(key for key in keys[:3]))
        assert (report.already_local, report.fetched, report.missing) == (0, 3, 0)
        again = node_b.warm(namespace, keys=iter([iter(keys)]))
        assert (again.already_local, again.fetched, again.missing) == (3, 3, 0)
        assert node_b.get(namespace, keys) == payloads


def test_eviction_before_upload_drops_queue_rows(tmp_path: Path, namespace) -> None:
    remote = f"memory://ucm-evict-{tmp_path.name}"
    keys, payloads = chain(namespace, 2)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=remote) as store:
        store.put(namespace, keys, payloads)
        store.delete(namespace, keys[:1])  # removes both (descendants go too)
        store.flush(upload_timeout_s=10)
        assert store.stats().pending_uploads == 0


def test_forked_child_reads_through_and_uploads(tmp_path: Path, namespace) -> None:
    import os

    remote = f"file://{tmp_path}/shared"
    keys, payloads = chain(namespace, 10)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=remote) as node_a:
        node_a.put(namespace, keys[:6], payloads[:6])
        node_a.flush()
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, remote=remote, remote_deadline_s=5.0) as node_b:
        assert node_b.get(namespace, [os.urandom(32) for _ in range(64)]) == [None] * 64  # fills the parent's read pool
        pid = os.fork()
        if pid == 0:  # child: its own read pool and uploader must work
            ok = node_b.lookup(namespace, keys) == 6 and node_b.get(namespace, keys[:6]) == payloads[:6]
            node_b.put(namespace, keys[6:], payloads[6:], parent=keys[5])
            try:
                node_b.flush(upload_timeout_s=20)
            except Exception:  # noqa: BLE001 - reported through the exit code
                ok = False
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    tier = RemoteRoot.from_url(remote).tier(namespace.digest[:16])
    assert sorted(tier.iterate()) == sorted(keys)


def test_locally_corrupt_block_is_served_from_the_remote(tmp_path: Path, namespace) -> None:
    remote = f"file://{tmp_path}/shared"
    keys, payloads = chain(namespace, 4)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=remote, remote_deadline_s=5.0) as store:
        store.put(namespace, keys, payloads)
        store.flush()
        (blob,) = store._tier.get_batch([keys[1]])
        damaged = bytearray(blob)
        damaged[-3] ^= 0x40
        store._tier.engine.write(lambda txn: txn.put("blocks", keys[1], bytes(damaged)))
        assert store.get(namespace, keys) == payloads  # the remote's verified copy, never the damaged bytes
        assert keys[1] in store._tier.quarantine_records()
        assert store.lookup(namespace, keys) == 4  # re-promoted from the remote
        assert store.get(namespace, keys) == payloads
        assert store._tier.check() == []


def test_uploader_batches_are_bounded_by_bytes_shallowest_first(tmp_path: Path, namespace, monkeypatch) -> None:
    import json as _json

    from ucm_db import codec as _codec
    from ucm_db.remote import uploader as uploader_module
    from ucm_db.index.local import BlockEntry

    keys, payloads = chain(namespace, 6)
    ns_id = namespace.digest[:16]
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP) as store:  # no remote: nothing drains behind our back
        entries = [BlockEntry.of_blob(k, keys[i - 1] if i else None, _codec.encode(k, p), len(p), ns_id)
                   for i, (k, p) in enumerate(zip(keys, payloads))]
        store._tier.put_blocks(entries, namespace_desc=(ns_id, _json.dumps(namespace.to_dict()).encode()), enqueue_upload=True)
        root = RemoteRoot.from_url(f"memory://ucm-batch-{tmp_path.name}")
        monkeypatch.setattr(uploader_module, "BATCH_BYTES", 1)
        uploader = uploader_module.Uploader(store._tier, root, store.path, concurrency=2)
        tier = root.tier(ns_id)
        for depth in range(6):
            assert uploader.drain_batch() == (1, 0)
            assert sorted(tier.iterate()) == sorted(keys[: depth + 1])  # ancestors go first
        assert uploader.drain_batch() == (0, 0)
        uploader.stop()


def test_short_lookup_fetches_each_block_once_without_a_search(remote: Remote, tmp_path: Path, namespace) -> None:
    """A continuation of at most DIRECT_FETCH_KEYS blocks is one request per
    block (the fetch finds the count; no probes first), hit or miss."""
    from ucm_db.remote.promotion import DIRECT_FETCH_KEYS

    keys, payloads = chain(namespace, DIRECT_FETCH_KEYS)
    held = DIRECT_FETCH_KEYS - 5
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as node_a:
        node_a.put(namespace, keys[:held], payloads[:held])
        node_a.flush()
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=5.0)) as node_b:
        stats = node_b._wing.link.root.stats
        assert node_b.lookup(namespace, keys) == held
        # + 1 request: the namespace manifest's epoch, read once at first contact (issue 48)
        assert (stats.requests, stats.gets, stats.misses) == (DIRECT_FETCH_KEYS + 1, DIRECT_FETCH_KEYS, 5)
        assert node_b._tier.count_prefix(keys) == held
        assert node_b.get(namespace, keys[:held]) == payloads[:held]


def test_lookup_past_a_missing_local_parent_makes_no_request(remote: Remote, tmp_path: Path, namespace) -> None:
    """A slice whose parent is not local (the connector's probe of one unit)
    could promote nothing: it is answered without asking the remote."""
    keys, payloads = chain(namespace, 20)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as node_a:
        node_a.put(namespace, keys, payloads)
        node_a.flush()
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=5.0)) as node_b:
        stats = node_b._wing.link.root.stats
        assert node_b.lookup(namespace, keys[10:11]) == 0
        assert stats.requests == 1 and stats.gets == 0  # only the namespace manifest's epoch, once (issue 48)
        node_b.put(namespace, keys[:10], payloads[:10])  # the parent is local now
        assert node_b.lookup(namespace, keys[10:11]) == 1
        assert stats.gets == 1  # (its own uploads may read the manifest)
        assert node_b.lookup(namespace, keys) == 20


def test_remote_read_concurrency_bounds_the_read_threads(remote: Remote, tmp_path: Path, namespace) -> None:
    keys, payloads = chain(namespace, 20)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as node_a:
        node_a.put(namespace, keys, payloads)
        node_a.flush()
        assert node_a._wing.link.read_threads == 16  # the default
    opened = ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=5.0, remote_read_concurrency=3))
    with opened as node_b:
        assert node_b._wing.link.read_threads == 3
        assert node_b.lookup(namespace, keys) == 20
    with pytest.raises(ConfigError, match="remote_read_concurrency"):
        ucm_db.open(tmp_path / "c", remote_read_concurrency=0, **remote.store_options())


def test_remote_max_object_bytes_bounds_what_is_read(remote: Remote, tmp_path: Path, namespace) -> None:
    """Objects larger than remote_max_object_bytes are misses (and are never
    read past their first request); the bound is checked at open."""
    keys, _ = chain(namespace, 4)
    big = [bytes([i]) * (2 << 20) for i in range(4)]  # 2 MiB blocks, stored raw
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, codec="none", **remote.store_options()) as node_a:
        node_a.put(namespace, keys, big)
        node_a.flush()
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=5.0, remote_max_object_bytes=1 << 20)) as node_b:
        assert node_b.get(namespace, keys) == [None] * 4
        # Refused as too large, not counted as corrupt (issue 26 item 21).
        assert node_b.stats().remote["too_large"] >= 1 and node_b.stats().remote["corrupt"] == 0
    with ucm_db.open(tmp_path / "c", capacity_bytes=CAP, **remote.store_options(remote_deadline_s=5.0)) as node_c:
        assert node_c.get(namespace, keys) == big  # the default (256 MiB) reads them
    for bad in (0, 1 << 40, "1"):
        with pytest.raises(ConfigError, match="remote_max_object_bytes"):
            ucm_db.open(tmp_path / "d", remote_max_object_bytes=bad, **remote.store_options())


def test_lookup_deadline_override(remote: Remote, tmp_path: Path, namespace) -> None:
    """A lookup off the serving path may wait longer than the store's
    remote_deadline_s; a deadline that is not a positive number is refused."""
    keys, payloads = chain(namespace, 20)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, **remote.store_options()) as node_a:
        node_a.put(namespace, keys, payloads)
        node_a.flush()
    with ucm_db.open(tmp_path / "b", capacity_bytes=CAP, **remote.store_options()) as node_b:
        for bad in (0, -1.0, "5", True):
            with pytest.raises(ConfigError, match="remote_deadline_s"):
                node_b.lookup(namespace, keys, remote_deadline_s=bad)
        assert node_b._tier.count_prefix(keys) == 0  # a refused call asked nothing
        assert node_b.lookup(namespace, keys, remote_deadline_s=10.0) == 20


def test_uploaded_counter_agrees_with_the_queue_when_flush_returns(tmp_path: Path, namespace, monkeypatch) -> None:
    """Issue 26 item 22: ``flush`` returns once the queue is empty, and the
    ``uploaded`` counter must already count what left it. The race window
    (the uploader deleting the rows before counting them) is made wide and
    deterministic by a delay injected after the queue delete: the only
    stand-in of this test, for a thread schedule that cannot be produced
    otherwise."""
    keys, payloads = chain(namespace, 3)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=f"file://{tmp_path / 'remote'}") as store:
        real_mark_uploaded = store._tier.mark_uploaded

        def mark_uploaded_then_pause(done: list[bytes]) -> None:
            real_mark_uploaded(done)
            time.sleep(0.5)

        monkeypatch.setattr(store._tier, "mark_uploaded", mark_uploaded_then_pause)
        store.put(namespace, keys, payloads)
        store.flush(upload_timeout_s=30)
        assert store.stats().pending_uploads == 0
        assert store.stats().remote["uploaded"] == 3


def test_a_write_through_upload_skips_what_the_uploader_already_took(tmp_path: Path, namespace) -> None:
    """The race behind a double count: the uploader thread drains a put's
    rows between its commit and its write-through upload. That upload then
    finds them dequeued and neither uploads nor counts them again."""
    keys, payloads = chain(namespace, 3)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=f"file://{tmp_path / 'remote'}") as store:
        store.put(namespace, keys, payloads)  # write-back: queued, the thread drains it
        store.flush()
        uploader = store._wing.uploader
        assert uploader.uploaded == 3 and store.stats().pending_uploads == 0
        items = [(k, None, namespace.digest[:16], b"not uploaded again") for k in keys]
        assert uploader.upload_now(items) == []
        assert uploader.uploaded == 3


def test_write_through_uploads_are_counted(tmp_path: Path, namespace) -> None:
    """Issue 26 item 22: a write-through put dequeues what it uploaded and
    counts it in ``uploaded`` like the background uploader does."""
    keys, payloads = chain(namespace, 3)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=f"file://{tmp_path / 'remote'}",
                     remote_mode="write_through") as store:
        store.put(namespace, keys, payloads)
        assert store.stats().pending_uploads == 0
        assert store.stats().remote["uploaded"] == 3


@pytest.mark.parametrize("codec_name", ["none", "zstd"])
def test_a_put_uploads_only_the_blocks_it_stored(tmp_path: Path, namespace, codec_name: str) -> None:
    """Issue 50 item 3: a put finds the blocks stored already inside its
    write transaction (codec none) or before encoding (zstd); either way
    only the blocks it stored are queued and handed to the write-through
    upload, never those it found."""
    keys, payloads = chain(namespace, 6)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=f"file://{tmp_path / 'remote'}",
                     remote_mode="write_through", codec=codec_name) as store:
        store.put(namespace, keys[:3], payloads[:3])
        handed: list[bytes] = []
        real = store._wing.upload
        store._wing.upload = lambda entries: (handed.extend(e.key for e in entries), real(entries))[1]  # type: ignore[method-assign]
        result = store.put(namespace, keys, payloads)
        assert (result.stored, result.already_present) == (3, 3)
        assert handed == list(keys[3:])
        assert store.stats().pending_uploads == 0 and store.stats().remote["uploaded"] == 6
