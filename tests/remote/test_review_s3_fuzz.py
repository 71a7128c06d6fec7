"""Seeded model-based review of the remote tier on S3 (s3fs against moto's server on 127.0.0.1).

Two nodes (LMDB stores, own local dirs, write-back or write-through by seed) share a bucket of a moto server that
is stopped and restarted. Seeds drive puts of chains sharing prefixes, reads and lookups (read-through), flushes,
reopens, remote deletes, objects damaged with boto3 behind the stores, the prefix emptied while uploaders run,
``ucm-db gc`` (past S3's 1000-key page: 1000 strays), hand-offs to new nodes, one outage. Invariants: no bytes
but a payload put for the key (any node); a fresh chain reaches a new node after a write-through put, a flush, or
a close, reopen and flush; a remote delete is served neither to the deleter nor to a node not holding the block;
down, local puts and reads work, errors are ``TierError`` only, nothing local is lost, flush succeeds once it is
back; damaged objects are misses; gc removes nothing young, counts every tombstone. Beside: racing reads; defects.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from click.testing import CliRunner
from moto.core import DEFAULT_ACCOUNT_ID
from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from moto.s3.models import s3_backends
from werkzeug.serving import make_server

import ucm_db
from ucm_db import Namespace, maintenance
from ucm_db.errors import TierError
from ucm_db.remote import manifests
from ucm_db.tools.cli import cli

from .conftest import BUCKET, Remote, _free_port, make_remote, s3_options

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]
NS = Namespace(model="test/review-s3-fuzz", kv_dtype="bfloat16", block_size=4, layout="test")
SEEDS = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233]
HEAD = struct.Struct("<16sII")  # key prefix, writer node, put step
CAP_BYTES, NEVER, STRAYS = 64 << 20, 1 << 30, 1000
DAMAGES = ("delete", "truncate", "bitflip", "extend", "swap")
OPS = {"put": 8, "read": 10, "flush": 3, "delete": 3, "damage": 2, "handoff": 2, "gc": 1, "empty": 1, "reopen": 1}
DOWN_OPS = {"put": 2, "read": 3, "delete": 1, "reopen": 1}


class SwitchedMoto(ThreadedMotoServer):
    """moto's threaded server polling for a stop every 20 ms (not 0.5 s); stopped and started on one port."""

    endpoint, up = "", False

    def _server_entry(self) -> None:
        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
        self._server_ready_event.set()
        self._server.serve_forever(poll_interval=0.02)

    def switch(self, up: bool) -> None:
        if up != self.up:
            (self.start if up else self.stop)()
            self.up = up


@pytest.fixture(scope="module")
def moto(s3_endpoint: str) -> Iterator[SwitchedMoto]:  # the same moto store; s3_endpoint quiets werkzeug's log
    port = _free_port()
    server = SwitchedMoto(ip_address="127.0.0.1", port=port, verbose=False)
    server.endpoint = f"http://127.0.0.1:{port}"
    server.switch(True)
    yield server
    server.switch(False)


def client(endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                        region_name="us-east-1")


def tokens_of(root: int, symbols: tuple[int, ...]) -> list[int]:
    return [t for i, s in enumerate(symbols) for t in (root, i, s, 7)]


def payload(key: bytes, node: int, step: int, size: int) -> bytes:
    head = HEAD.pack(key[:16], node, step)
    return head + hashlib.shake_256(head).digest(size - HEAD.size)


@dataclass
class Retraction:
    """A remote delete of a key: the payloads it retired, and who may still see them."""
    payloads: set[bytes]
    deleter: int
    effective_at: int | None  # the step its delete reached the remote (at once, or at the deleter's flush)
    revivable: bool  # another node may upload one of them again


class Fleet:
    """Two nodes on one bucket, the model (payloads put, what each node touched, queued, deleted), the steps."""

    def __init__(self, tmp: Path, seed: int, moto: SwitchedMoto) -> None:
        self.rng, self.tmp, self.moto = random.Random(seed), tmp, moto
        self.s3, self.bucket = client(moto.endpoint), f"review-s3-fuzz-{uuid.uuid4().hex[:12]}"
        self.s3.create_bucket(Bucket=self.bucket)
        self.url, self.options = f"s3://{self.bucket}/kv", s3_options(moto.endpoint)
        self.options["config_kwargs"]["retries"] = {"total_max_attempts": 1}  # a refused request fails at once
        self.plant_strays()
        self.modes = [self.rng.choice(("write_back", "write_through")) for _ in range(2)]
        self.stores = [self.open(f"node{n}", self.modes[n]) for n in range(2)]
        self.puts, self.retractions = dict[bytes, set[bytes]](), dict[bytes, list[Retraction]]()
        self.touched: dict[int, dict[bytes, int]] = {0: {}, 1: {}}  # node -> key -> step it first read or put it
        self.queued: dict[int, dict[bytes, bytes]] = {0: {}, 1: {}}  # node -> its puts not flushed yet
        self.chains: dict[tuple[bytes, ...], list[bytes]] = {}
        self.fresh_keys: set[bytes] = set()  # of the hand-offs: never deleted
        self.step = self.readers = 0
        self.waiting, self.dropped = [0, 0], [set[bytes](), set[bytes]()]

    def open(self, name: str, mode: str = "write_back") -> ucm_db.Store:
        return ucm_db.open(self.tmp / name, capacity_bytes=CAP_BYTES, codec="none", remote=self.url,
                           remote_options=dict(self.options), remote_mode=mode, remote_deadline_s=1)

    def chain(self, node: int, fresh: bool = False) -> list[bytes]:
        """A chain of the shared prefixes (or a fresh one, never seen), touched by ``node``."""
        symbols = tuple(self.rng.randrange(2) for _ in range(self.rng.randint(1, 6 if fresh else 3)))
        keys = list(NS.block_keys(tokens_of(1000 + len(self.chains) if fresh else self.rng.randrange(2), symbols)))
        self.chains[tuple(keys)] = keys
        self.fresh_keys |= set(keys) if fresh else set()
        self.touched[node] = {**{k: self.step for k in keys}, **self.touched[node]}
        return keys

    def check(self, node: int, key: bytes, block: bytearray | bytes | None) -> None:
        got = None if block is None else bytes(block)
        assert got is None or got in self.puts.get(key, set()), f"node {node}: bytes never put for {key.hex()[:12]}"
        for r in self.retractions.get(key, []):
            if got in r.payloads and r.effective_at is not None:
                held = self.touched.get(node, {}).get(key, NEVER) < r.effective_at  # read before it: its own copy
                assert node != r.deleter and (held or r.revivable), (
                    f"node {node}: {key.hex()[:12]} served, retracted by node {r.deleter} at step {r.effective_at}")

    def local(self, node: int) -> dict[bytes, bytes]:  # every block of a known chain the node holds
        keys = list({k: 0 for chain in self.chains.values() for k in chain})
        held = [k for k, n in zip(keys, self.stores[node].lookup_many(NS, [[k] for k in keys])) if n]
        return {k: bytes(g) for k, g in zip(held, self.stores[node].get(NS, held)) if g is not None}

    def still_local(self, node: int, before: dict[bytes, bytes], dropped: set[bytes]) -> None:
        keys = [k for k in before if k not in dropped]
        lost = [k.hex()[:12] for k, g in zip(keys, self.stores[node].get(NS, keys)) if g != before[k]]
        assert not lost, f"node {node} lost or changed blocks it held (server up: {self.moto.up}): {lost}"

    def plant_strays(self) -> None:  # sorting first: gc lists past S3's 1000-key page (HTTP PUTs would take ~3 s)
        for i in range(STRAYS):
            s3_backends[DEFAULT_ACCOUNT_ID]["global"].put_object(self.bucket, f"kv/{NS.short_id}/00/{i}", b"x")

    def names(self, prefix: str = "kv/", after: str = "") -> list[str]:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix, StartAfter=after)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    # -- steps --------------------------------------------------------------------------------------------------
    def op_put(self, node: int, fresh: bool = False) -> list[bytes]:
        store, keys = self.stores[node], self.chain(node, fresh)
        done, failed = store.lookup(NS, keys), False
        payloads = [payload(k, node, self.step, self.rng.randint(1, 4) << 10) for k in keys[done:]]
        try:
            store.put(NS, keys[done:], payloads, parent=keys[done - 1] if done else None)
        except TierError as exc:  # write-through: the blocks are stored and queued (docs/remote.md)
            assert self.modes[node] == "write_through" and not self.moto.up, f"put failed: {exc}"
            failed = True
        assert store.lookup(NS, keys, remote=False) == len(keys), f"node {node}: put did not store its chain"
        for key, data in zip(keys[done:], payloads):
            self.puts.setdefault(key, set()).add(data)
            if self.modes[node] == "write_back" or failed:
                self.queued[node][key] = data
        self.waiting[node] += len(keys) - done
        return keys

    def op_read(self, node: int) -> None:
        keys = self.chain(node)
        counted = self.stores[node].lookup(NS, keys) if self.rng.random() < 0.4 else None
        got = self.stores[node].get(NS, keys if counted is None else keys[:counted])
        assert counted is None or all(k in self.puts for k in keys[:counted]) and None not in got, (
            f"node {node}: lookup counted {counted} (served {got.count(None)} fewer, or never put)")
        for key, block in zip(keys, got):
            self.check(node, key, block)

    def op_flush(self, node: int) -> None:
        if not self.moto.up:
            try:  # TierError naming what waits; nothing else
                self.stores[node].flush(upload_timeout_s=0.2)
                assert not self.waiting[node], "flush returned with uploads queued and the server down"
            except TierError as exc:
                assert "still waiting" in str(exc), exc
        else:
            self.stores[node].flush(upload_timeout_s=30)
            self.queued[node].clear()
            for r in (r for rs in self.retractions.values() for r in rs if r.deleter == node):
                r.effective_at = self.step if r.effective_at is None else r.effective_at

    def op_delete(self, node: int) -> None:
        key = self.rng.choice([k for k in self.puts if k not in self.fresh_keys] or self.chain(node))  # mostly put
        self.stores[node].delete(NS, [key], remote=True)
        if key in self.puts:
            self.retractions.setdefault(key, []).append(Retraction(set(self.puts[key]), node, self.step if self.moto.up
                                                                   else None, key in self.queued[1 - node]))
        self.queued[node].pop(key, None)
        self.dropped[node] |= {k for chain in self.chains.values() if key in chain for k in chain[chain.index(key):]}

    def op_reopen(self, node: int) -> None:
        self.stores[node].close()
        self.stores[node] = self.open(f"node{node}", self.modes[node])

    def op_damage(self, _node: int) -> None:
        for n in range(2):
            self.op_flush(n)  # nothing queued then puts a damaged object back
        names = [n for n in self.names(f"kv/{NS.short_id}/", f"kv/{NS.short_id}/00/~") if "." not in n[-12:]]
        if len(names) < 2:
            return
        name, other = self.rng.sample(names, 2)
        key, kind = bytes.fromhex(name.rsplit("/", 1)[1]), self.rng.choice(DAMAGES)
        body = self.s3.get_object(Bucket=self.bucket, Key=name)["Body"].read()
        at = self.rng.randrange(1, len(body))
        damaged = {"truncate": body[:at], "extend": body + body[:at], "delete": b"",
                   "bitflip": body[:at] + bytes([body[at] ^ 1 << at % 8]) + body[at + 1:],
                   "swap": self.s3.get_object(Bucket=self.bucket, Key=other)["Body"].read()}[kind]
        if kind == "swap" and key in damaged:  # an earlier swap moved an object of this key there
            return
        if kind == "delete":
            self.s3.delete_object(Bucket=self.bucket, Key=name)
        else:
            self.s3.put_object(Bucket=self.bucket, Key=name, Body=damaged)
        for node, store in enumerate(self.stores):
            if store.lookup_many(NS, [[key]]) == [0]:
                assert store.get(NS, [key]) == [None], f"node {node}: {kind} object of {key.hex()[:12]} served"

    def op_empty(self, _node: int) -> None:  # every object of the prefix (manifest, tombstones) while uploaders run
        names = [{"Key": n} for n in self.names() if not n.rsplit("/", 1)[1].isdigit()]  # the strays stay
        if names:
            self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": names})
        for key, rs in self.retractions.items():
            for r in rs:  # its tombstone gone, a node holding the block may put it back as a lost parent
                r.revivable |= self.touched[1 - r.deleter].get(key, NEVER) < (r.effective_at or NEVER)

    def op_gc(self, _node: int) -> None:
        """``ucm-db gc``, of objects over an hour old (none) or of all."""
        for n in range(2):
            self.op_flush(n)
        options = [f"--option={k}={self.options[k]}" for k in ("endpoint_url", "key", "secret")]
        young = self.rng.random() < 0.6
        result = CliRunner().invoke(cli, ["gc", self.url, "--older-than", "1h" if young else "0s", "--json", *options])
        report, names = json.loads(result.stdout), self.names()
        assert result.exit_code == 0 and (not young or report["removed_objects"] == 0), result.output
        if f"kv/{NS.short_id}/manifest.json" in names:  # without one gc skips the namespace (defect below)
            tombstones = [n for n in names if n.endswith(".retracted")]
            assert (report["skipped_entries"], report["tombstones"]) == (STRAYS, len(tombstones)), (
                report, tombstones)
            if not young and report["held_namespaces"] == 0:
                assert not [n for n in names if len(n.rsplit("/", 1)[1]) == 64], "gc of all left objects"

    def op_handoff(self, node: int) -> None:  # a fresh chain put on ``node`` reaches a new node
        keys = self.op_put(node, fresh=True)
        if self.modes[node] == "write_back":
            if self.rng.random() < 0.5:
                self.op_reopen(node)  # closed with its uploads queued: the reopened node's uploader sends them
            self.op_flush(node)
        self.read_fresh([keys])

    def read_fresh(self, chains: list[list[bytes]]) -> None:
        """A new node reads ``chains`` whole (read through into its local tier), then what else is known."""
        self.readers += 1
        with self.open(f"reader{self.readers}") as store:
            for keys in chains:
                got = [None if g is None else bytes(g) for g in store.get(NS, keys)]
                assert got == [next(iter(self.puts[k])) for k in keys], "a new node missed a flushed fresh chain"
                assert store.lookup(NS, keys, remote=False) == len(keys), "read-through did not promote"
            known = self.rng.sample(list(self.chains.values()), min(3, len(self.chains)))
            for keys in [*([k] for k in self.retractions), *known]:
                for key, block in zip(keys, store.get(NS, keys)):
                    self.check(100 + self.readers, key, block)

    def op_outage(self, _node: int) -> None:
        before, self.dropped, self.waiting = [self.local(n) for n in range(2)], [set(), set()], [0, 0]
        self.moto.switch(False)
        fresh = [self.op_put(n, fresh=True) for n in range(2)]  # write-through: TierError, stored and queued
        self.op_flush(self.rng.randrange(2))  # TierError: its puts wait
        for what in self.rng.choices(list(DOWN_OPS), list(DOWN_OPS.values()), k=3):
            getattr(self, f"op_{what}")(self.rng.randrange(2))
        for n in range(2):
            self.still_local(n, before[n], self.dropped[n])
        self.moto.switch(True)
        for n in range(2):
            self.op_flush(n)
            self.still_local(n, before[n], self.dropped[n])
        self.read_fresh(fresh)

    def run(self, steps: int) -> None:
        outage_at = self.rng.randrange(steps // 3, steps)
        for self.step in range(1, steps + 1):
            name = "outage" if self.step == outage_at else self.rng.choices(list(OPS), list(OPS.values()))[0]
            getattr(self, f"op_{name}")(self.rng.randrange(2))
        self.op_handoff(self.rng.randrange(2))


@pytest.mark.parametrize("seed", SEEDS)
def test_two_nodes_sharing_a_bucket_never_serve_wrong_lost_or_retracted_blocks(tmp_path: Path, moto: SwitchedMoto,
                                                                              seed: int) -> None:
    fleet = Fleet(tmp_path, seed, moto)
    try:
        fleet.run(steps=22)
    finally:
        moto.switch(True)
        for store in fleet.stores:
            store.close()
    assert fleet.puts and fleet.readers, "the run stored nothing or handed nothing off"


# -- beside the fuzz ------------------------------------------------------------------------------------------
def written_through(tmp: Path, remote: Remote, keys: list[bytes], node: int = 0, big: bool = False) -> list[bytes]:
    """Puts the chain ``keys`` write-through from store ``writer<node>``; ``big``: its second block 8 MiB + 64 KiB."""
    data = [payload(k, node, 0, (8 << 20) + (64 << 10) if big and i == 1 else 2048) for i, k in enumerate(keys)]
    with ucm_db.open(tmp / f"writer{node}", capacity_bytes=CAP_BYTES, codec="none", remote_mode="write_through",
                     **remote.store_options()) as store:
        store.put(NS, keys, data, parent=None)
    return data


def object_name(remote: Remote, key: bytes) -> str:
    return f"{remote.url.removeprefix(f's3://{BUCKET}/')}/{NS.short_id}/{key[:1].hex()}/{key.hex()}"


def test_reads_racing_overwrites_and_deletes_never_serve_wrong_bytes(tmp_path: Path,
                                                                    request: pytest.FixtureRequest) -> None:
    """Objects replaced (two nodes' valid ones, damaged ones) and deleted while a node reads them through; the
    big one takes two ranged reads (8 MiB first), so a replace can fall between them."""
    remote, keys = make_remote("s3", tmp_path, request), list(NS.block_keys(tokens_of(7, (1, 1, 0))))
    s3, names, versions, bodies = client(remote.options["endpoint_url"]), [object_name(remote, k) for k in keys], [], []
    for node in range(2):  # node 1's objects replace node 0's
        versions.append(written_through(tmp_path, remote, keys, node, big=True))
        bodies.append([s3.get_object(Bucket=BUCKET, Key=name)["Body"].read() for name in names])
    stop, rng, served = threading.Event(), random.Random(11), 0

    def race() -> None:
        while not stop.is_set():
            i, kind = rng.randrange(len(keys)), rng.choice(("put", "put", "cut", "flip", "delete"))
            whole = bodies[rng.randrange(2)][i]
            body = {"put": whole, "cut": whole[:-5], "flip": whole[:-5] + bytes([whole[-5] ^ 1]) + whole[-4:]}.get(kind)
            if body is None:
                s3.delete_object(Bucket=BUCKET, Key=names[i])
            else:
                s3.put_object(Bucket=BUCKET, Key=names[i], Body=body)

    racer = threading.Thread(target=race, daemon=True)
    with ucm_db.open(tmp_path / "node", capacity_bytes=CAP_BYTES, **remote.store_options(remote_deadline_s=5)) as store:
        racer.start()
        try:
            for _ in range(10):
                for i, got in enumerate(store.get(NS, keys)):
                    assert got is None or bytes(got) in (versions[0][i], versions[1][i]), f"wrong bytes, block {i}"
                    served += got is not None
                store.delete(NS, keys)  # local only: the next round reads through again
        finally:
            stop.set()
            racer.join()
    assert served, "no read got through the race"


def test_a_prefix_emptied_under_a_running_node_gets_its_manifest_back(tmp_path: Path, request: pytest.FixtureRequest,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An S3 lifecycle rule expiring old objects takes ``manifest.json`` (a namespace's oldest) first (was: written
    once per process, so later uploads landed without one and gc skipped them forever). The recheck's minute is 0 here."""
    monkeypatch.setattr(manifests, "MANIFEST_RECHECK_S", 0.0)
    remote, chains = make_remote("s3", tmp_path, request), [list(NS.block_keys(tokens_of(r, (0, 1)))) for r in (1, 2)]
    s3, prefix = client(remote.options["endpoint_url"]), object_name(remote, bytes(32)).split("/")[0] + "/"
    with ucm_db.open(tmp_path / "node", capacity_bytes=CAP_BYTES, **remote.store_options()) as store:
        for n, keys in enumerate(chains):
            store.put(NS, keys, [payload(k, 0, n, 1024) for k in keys], parent=None)
            store.flush(upload_timeout_s=30)
            names = [{"Key": o["Key"]} for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]]
            if n == 0:  # everything of the namespace, while the node runs
                s3.delete_objects(Bucket=BUCKET, Delete={"Objects": names})
    report = maintenance.gc_remote(remote.url, remote.options, older_than_s=0)
    assert (report["objects_before"], report["skipped_entries"]) == (len(chains[1]), 0), report


def test_a_zero_byte_object_is_a_corrupt_miss_and_a_stray_to_gc(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """As a one-byte object there is: a corrupt miss (the chain's other blocks read), a stray skipped by gc (was: S3's
    416 InvalidRange taken for a failing remote: the breaker tripped, gc called it unreadable every run)."""
    remote, keys = make_remote("s3", tmp_path, request), list(NS.block_keys(tokens_of(3, (1, 0, 1, 1))))
    data = written_through(tmp_path, remote, keys)
    client(remote.options["endpoint_url"]).put_object(Bucket=BUCKET, Key=object_name(remote, keys[1]), Body=b"")
    with ucm_db.open(tmp_path / "node", capacity_bytes=CAP_BYTES, **remote.store_options(remote_deadline_s=5)) as store:
        got, stats = [None if g is None else bytes(g) for g in store.get(NS, keys)], store.stats().remote
    report = maintenance.gc_remote(remote.url, remote.options, older_than_s=0)
    assert (got, stats["corrupt"], stats["errors"]) == ([data[0], None, *data[2:]], 1, 0), stats
    assert (report["unreadable"], report["skipped_entries"]) == (0, 1), report
