"""Seeded attacks on the objects of a keyed, sealed or plain ``file://`` remote (review of issue 46's promises).

Per seed, a secret profile for the writers (none, an HMAC key, an AES-256-GCM key, or both) and one for a fresh
reader (the same keys, a rotation [new, old], another key, no key, or the keys from environment variables). Two
generations of writers upload the same keys (chain X under namespaces NA and NB with other payloads there, chain
Y under NB): generation 1 under the *old* profile, kept aside, then the remote is wiped and generation 2 under
the current one. An attacker then mutates the remote directory: byte flips, truncation, extension, an object
copied over another's path, an envelope rewritten for another key, parent or namespace (its unkeyed checksum
recomputed), a version or length field altered, the two namespace directories swapped, a generation-1 object
replayed, an object packed by the attacker (no key, or a key of its own), the root's key markers deleted,
a symlink in an object's place. Sometimes ``gc`` runs over the result. Then a fresh reader looks up, gets, warms.

Invariants checked:
    * never wrong bytes: every payload a lookup, get or warm yields for (namespace, key) is the one generation 2
      put there, or generation 1's where that object was replayed and the reader's keys accept generation 1's
      profile (trust.md: an old signed object for the same key is not protected);
    * a reader lacking a kind of key the writers used is refused at open (``ConfigError``) while the root's
      marker of that kind is there; otherwise an object it cannot verify is a miss, never an exception;
    * a reader whose keys accept generation 2 gets every block the attacker left alone (no over-refusal).

40 seeds (odd ones with ``UCM_DB_INLINE_READS=0``: pooled reads); chain X has 18 blocks (a lookup searches).
Scenario tests pin a replay after a retraction, an extended object stating exactly the first read's 8 MiB (a
miss: fixed), and a limit (strict xfail): a parent object cut short past its envelope is never uploaded again.
"""

from __future__ import annotations

import random
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import xxhash

import ucm_db
import ucm_db.maintenance
from ucm_db import Namespace, codec
from ucm_db.auth import AuthKeys
from ucm_db.errors import ConfigError
from ucm_db.remote import sealing
from ucm_db.remote.envelope import ENVELOPE_BYTES, pack_object
from ucm_db.remote.warming import RemoteEpochUnknownError

from .conftest import key_file

pytestmark = pytest.mark.timeout(120)
CAP = 64 << 20
NA = Namespace(model="test/review-seal-a", kv_dtype="bfloat16", block_size=4, layout="test")
NB = Namespace(model="test/review-seal-b", kv_dtype="bfloat16", block_size=4, layout="test")
BLOCK_BYTES = 3 << 10
#: Key material by name: A* authenticate (HMAC), E* encrypt; *0 old, *1 current, *9 another fleet's.
SECRETS = {name: bytes([i + 1]) * 32 for i, name in enumerate(["A0", "A1", "A9", "E0", "E1", "E9", "X"])}
SEEDS = list(range(40))


@dataclass(frozen=True)
class Profile:
    """A node's keys by name: auth (the first signs), encryption (the first seals), and where they come from."""
    auth: tuple[str, ...] = ()
    enc: tuple[str, ...] = ()
    source: str = "file"  # "file", "env", or "split": the first key from the file, the others from the variable

    def options(self, tmp_path: Path, tag: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind, names in (("auth", self.auth), ("encryption", self.enc)):
            in_file = names if self.source == "file" else names[:1] if self.source == "split" else ()
            in_env = names[len(in_file):]
            if in_file:
                secrets = [SECRETS[n] for n in in_file]
                out[f"remote_{kind}_key_file"] = key_file(tmp_path, *secrets, name=f"{tag}-{kind}.key")
            if in_env:
                variable = f"UCM_REVIEW_{kind.upper()}_{tag.upper()}"
                monkeypatch.setenv(variable, ", ".join(SECRETS[n].hex() for n in in_env))
                out[f"remote_{kind}_key_env"] = variable
        return out

    def accepts(self, writer: Profile) -> bool:
        """Whether this reader serves objects ``writer`` packs (docs/configuration.md: a MAC no key of ours made
        and a seal no key of ours opens are misses; a keyed reader misses plaintext; a keyless one ignores MACs)."""
        if self.auth and (not writer.auth or writer.auth[0] not in self.auth):
            return False
        if self.enc:
            return bool(writer.enc) and writer.enc[0] in self.enc
        return not writer.enc


WRITERS = [Profile(), Profile(auth=("A1",)), Profile(enc=("E1",)), Profile(auth=("A1",), enc=("E1",))]


def old_profile(current: Profile, rng: random.Random) -> Profile:
    """Generation 1's keys: the old ones of the same kinds, the current ones, or none."""
    rotated_out = Profile(("A0",) if current.auth else (), ("E0",) if current.enc else ())
    return rng.choice([rotated_out, current, Profile()])


def reader_profile(writer: Profile, rng: random.Random) -> Profile:
    source = rng.choice(["file", "env", "split"])
    rotated = Profile(("A1", "A0") if writer.auth else (), ("E1", "E0") if writer.enc else (), source)
    other = Profile(("A9",) if writer.auth else (), ("E9",) if writer.enc or not writer.auth else (), source)
    same = Profile(writer.auth, writer.enc, source)
    return rng.choice([same, same, rotated, rotated, other, Profile(), Profile(("A1",), ("E1",), source)])


def payload(tag: bytes, key: bytes, rng: random.Random) -> bytes:
    return (tag.ljust(16, b".") + key + rng.randbytes(BLOCK_BYTES - 48))


@dataclass
class World:
    """The keys, what each generation put, where the objects lie, and what the attacker touched."""

    remote: Path
    x: list[bytes]  # keys of NA, put under NA and (other payloads) under NB: long enough for the prefix search
    y: list[bytes]  # keys of NB
    new: dict[tuple[str, bytes], bytes] = field(default_factory=dict)
    old: dict[tuple[str, bytes], bytes] = field(default_factory=dict)
    old_objects: dict[tuple[str, bytes], bytes] = field(default_factory=dict)
    touched: set[tuple[str, bytes]] = field(default_factory=set)
    replayed: set[tuple[str, bytes]] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"file://{self.remote}"

    def chains(self) -> dict[str, list[list[bytes]]]:
        return {"A": [self.x], "B": [self.x, self.y]}

    def objects(self) -> list[tuple[str, bytes]]:
        return [(ns, k) for ns, chains in self.chains().items() for c in chains for k in c]

    def path(self, ns: str, key: bytes) -> Path:
        return self.remote / ns_of(ns).short_id / key[:1].hex() / key.hex()

    def untouched_prefix(self, ns: str, keys: list[bytes]) -> int:
        """Leading keys of a chain the attacker left alone, ancestors included (gc may take a broken one's children)."""
        return next((i for i, k in enumerate(keys) if (ns, k) in self.touched), len(keys))


def ns_of(name: str) -> Namespace:
    return NA if name == "A" else NB


def write_generation(world: World, tmp_path: Path, gen: int, profile: Profile, rng: random.Random,
                     monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, bytes], bytes]:
    """Writer stores (one per namespace: chain X's keys are put under both) upload generation ``gen``."""
    put: dict[tuple[str, bytes], bytes] = {}
    for ns, chains in world.chains().items():
        options = profile.options(tmp_path, f"w{gen}{ns}", monkeypatch)
        with ucm_db.open(tmp_path / f"writer{gen}{ns}", capacity_bytes=CAP, remote=world.url,
                         remote_mode="write_through", **options) as store:
            for keys in chains:
                payloads = [payload(b"g%d%s" % (gen, ns.encode()), k, rng) for k in keys]
                store.put(ns_of(ns), keys, payloads)
                put.update({(ns, k): p for k, p in zip(keys, payloads)})
    return put


def reforge(obj: bytes, key: bytes, *, parent: bytes | None = None, ns_id: bytes | None = None,
            version: int | None = None, flags: int | None = None) -> bytes:
    """What anyone can do: rewrite envelope fields and recompute the envelope's unkeyed checksum for ``key``."""
    head = bytearray(obj[:ENVELOPE_BYTES].ljust(ENVELOPE_BYTES, b"\0"))
    for at, value in ((4, version), (6, flags)):
        if value is not None:
            head[at : at + 2] = struct.pack("<H", value)
    if ns_id is not None:
        head[8:24] = ns_id
    if parent is not None:
        head[24:56] = parent
    head[56:64] = struct.pack("<Q", xxhash.xxh3_64(bytes(head[:56]) + bytes(8) + key).intdigest())
    return bytes(head) + obj[ENVELOPE_BYTES:]


def mutated(world: World, name: str, target: tuple[str, bytes], data: bytes, rng: random.Random) -> bytes | None:
    """The attacked bytes of ``target``'s object; None when the mutation was done in place (or not at all)."""
    ns, key = target
    other = world.path(*rng.choice([o for o in world.objects() if o != target]))
    if name == "flip":
        bad = bytearray(data)
        for at in rng.sample(range(len(bad)), min(len(bad), rng.randint(1, 3))):
            bad[at] ^= rng.randrange(1, 256)
        return bytes(bad)
    if name == "truncate":
        return data[: rng.randrange(len(data))]
    if name == "extend":
        return data + (data[-40:] if rng.random() < 0.5 else rng.randbytes(rng.randint(1, 64)))
    if name == "copy":
        return other.read_bytes() if other.exists() else None
    if name == "symlink":  # to another object; never followed (a quarantined miss)
        world.path(*target).unlink()
        world.path(*target).symlink_to(other)
        return None
    if name == "version":
        version, flags = rng.choice([(1, 0), (1, 1), (2, 1), (3, 1), (3, 3), (2, 3)])
        data = reforge(data, key, version=version, flags=flags)
        return data[:-40] if rng.random() < 0.5 else data  # and perhaps the MAC trailer stripped
    if name == "length":  # the sealed head's plain length, the codec header's raw or body length
        at = ENVELOPE_BYTES + rng.choice([sealing.HEAD_BYTES - 8, 12])
        value = struct.unpack_from("<Q", data, at)[0]
        return data[:at] + struct.pack("<Q", max(0, value + rng.choice([-16, -1, 1, 16]))) + data[at + 8 :]
    if name == "replay":
        world.replayed.add(target)
        return world.old_objects[target]
    chain = world.x if key in world.x else world.y
    if name == "reforge_key":  # another object's bytes, its envelope made right for this key, parent and namespace
        index = chain.index(key)
        return reforge(other.read_bytes(), key, parent=chain[index - 1] if index else None,
                       ns_id=ns_of(ns).id) if other.exists() else None
    if name == "reparent":
        return reforge(data, key, parent=rng.choice(world.objects())[1])
    if name == "renamespace":  # the same key's object of the other namespace, its envelope made this one's
        twin = world.path("B" if ns == "A" else "A", key)
        return reforge(twin.read_bytes(), key, ns_id=ns_of(ns).id) if twin.exists() else None
    assert name == "plant"
    signer = AuthKeys((SECRETS["X"],), "attacker") if rng.random() < 0.5 else None
    blob = codec.encode(key, payload(b"forged", key, rng), codec="none")
    index = chain.index(key)
    return pack_object(key, chain[index - 1] if index else None, ns_of(ns).id, blob, signer)


def attack(world: World, rng: random.Random, reader: Profile) -> list[str]:
    """Applies 1-4 seeded mutations to the remote; returns their names (for failure messages)."""
    keyed = bool(reader.auth or reader.enc)  # forging needs a key to defeat: without one it is not protected
    names = ["flip", "truncate", "extend", "copy", "symlink", "version", "length", "replay", "swap_dirs", "marker"]
    forgeries = ["reforge_key", "reparent", "renamespace", "renamespace", "plant"] if keyed else []
    done = []
    for name in rng.sample(forgeries, min(1, len(forgeries))) + rng.sample(names, rng.randint(0, 3)):
        if name == "swap_dirs":
            a, b = world.remote / NA.short_id, world.remote / NB.short_id
            a.rename(world.remote / "swap")
            b.rename(a)
            (world.remote / "swap").rename(b)
            world.touched.update(world.objects())
        elif name == "marker":
            for marker in ("auth.json", "encryption.json"):
                (world.remote / marker).unlink(missing_ok=True)
        else:
            target = rng.choice(world.objects())
            path = world.path(*target)
            if not path.is_file() or path.is_symlink() or path.stat().st_size < ENVELOPE_BYTES + sealing.HEAD_BYTES:
                continue
            world.touched.add(target)
            data = mutated(world, name, target, path.read_bytes(), rng)
            if data is not None:
                path.write_bytes(data)
        done.append(name)
    return done


def refused_at_open(world: World, reader: Profile) -> bool:
    return (not reader.auth and (world.remote / "auth.json").exists()) or (
        not reader.enc and (world.remote / "encryption.json").exists())


@dataclass
class Reading:
    """One reader's view: the world, its keys and the writers', and the story for failure messages."""

    world: World
    reader: Profile
    writer: Profile
    old: Profile
    story: str

    def allowed(self, target: tuple[str, bytes]) -> set[bytes]:
        ok = {self.world.new[target]} if self.reader.accepts(self.writer) else set()
        replayed = target in self.world.replayed and self.reader.accepts(self.old)
        return ok | {self.world.old[target]} if replayed else ok

    def check(self, ns: str, keys: list[bytes], got: list[Any], how: str) -> None:
        for key, data in zip(keys, got):
            assert data is None or bytes(data) in self.allowed((ns, key)), \
                f"{how} served wrong bytes for {ns}:{key.hex()[:12]} ({self.story})"

    def live(self, ns: str, keys: list[bytes]) -> int:
        """Leading blocks a reader must find: untouched, and of a profile it accepts."""
        return self.world.untouched_prefix(ns, keys) if self.reader.accepts(self.writer) else 0


def read_everything(reading: Reading, tmp_path: Path, options: dict[str, Any]) -> None:
    world = reading.world
    opened = {"capacity_bytes": CAP, "remote": world.url, "remote_deadline_s": 5, **options}
    with ucm_db.open(tmp_path / "reader", **opened) as store:
        for ns, chains in world.chains().items():
            for keys in chains:
                n = store.lookup(ns_of(ns), keys)
                if keys is world.y or ns == "A":  # NB's X is local under NA here: served, never promoted
                    assert n >= reading.live(ns, keys), f"lookup {ns} found {n} ({reading.story})"
                reading.check(ns, keys[:n], store.get(ns_of(ns), keys[:n]), "lookup")
                got = store.get(ns_of(ns), keys)
                reading.check(ns, keys, got, "get")
                live = reading.live(ns, keys)
                assert None not in got[:live], f"get {ns} missed untouched blocks ({reading.story})"
    for ns, chains in world.chains().items():  # a warmer per namespace: X is under both
        with ucm_db.open(tmp_path / f"warm{ns}", **opened) as store:
            try:
                report = store.warm(ns_of(ns), keys=chains)
                assert report.fetched >= sum(reading.live(ns, c) for c in chains), reading.story
            except RemoteEpochUnknownError:
                pass  # a manifest moved away or refused: nothing fetched (documented)
        with ucm_db.open(tmp_path / f"warm{ns}") as local:  # what warm promoted, read without the remote
            for keys in chains:
                reading.check(ns, keys, local.get(ns_of(ns), keys), "warm")


@pytest.mark.parametrize("seed", SEEDS)
def test_attacked_remote_never_serves_wrong_bytes(tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    writer = WRITERS[seed % len(WRITERS)]
    old, reader = old_profile(writer, rng), reader_profile(writer, rng)
    tokens = [rng.randrange(50_000) for _ in range(4 * 22)]
    world = World(tmp_path / "remote", NA.block_keys(tokens[:72]), NB.block_keys(tokens[72:]))
    world.old = write_generation(world, tmp_path, 1, old, rng, monkeypatch)
    world.old_objects = {t: world.path(*t).read_bytes() for t in world.old}
    shutil.rmtree(world.remote)
    world.new = write_generation(world, tmp_path, 2, writer, rng, monkeypatch)
    done = attack(world, rng, reader)
    if rng.random() < 0.3:
        ucm_db.maintenance.gc_remote(world.url, older_than_s=365 * 86400.0)
    if seed % 2:
        monkeypatch.setenv("UCM_DB_INLINE_READS", "0")  # the pooled reads, as on NFS or S3
    story = f"seed {seed}: writer {writer}, old {old}, reader {reader}, attacks {done}"
    options = reader.options(tmp_path, "r", monkeypatch)
    if refused_at_open(world, reader):  # a kind of key the fleet uses is missing: refused, naming the marker
        with pytest.raises(ConfigError, match=r"auth\.json|encryption\.json"):
            ucm_db.open(tmp_path / "refused", capacity_bytes=CAP, remote=world.url, **options)
        return
    read_everything(Reading(world, reader, writer, old, story), tmp_path, options)


def _chain(n_blocks: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    rng = random.Random(seed)
    keys = NA.block_keys([rng.randrange(50_000) for _ in range(4 * n_blocks)])
    return keys, [payload(b"scenario", k, rng) for k in keys]


def test_retracting_node_never_reads_back_a_replayed_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """remote.md: while a retraction exists (and an hour after), the block is never fetched, read through or
    promoted. An attacker restores the signed, sealed objects the delete removed: the deleting node misses them
    in lookup, get and warm (a fresh node would serve them: trust.md, an old signed object is not protected)."""
    keys, payloads = _chain(4, seed=1)
    keyed = {**Profile(("A1",), ("E1",)).options(tmp_path, "k", monkeypatch), "remote_deadline_s": 5}
    url = f"file://{tmp_path}/remote"
    with ucm_db.open(tmp_path / "node", capacity_bytes=CAP, remote=url, remote_mode="write_through", **keyed) as node:
        node.put(NA, keys, payloads)
        paths = [tmp_path / "remote" / NA.short_id / k[:1].hex() / k.hex() for k in keys]
        saved = [p.read_bytes() for p in paths]
        node.delete(NA, keys[2:], remote=True)
        assert [p.exists() for p in paths] == [True, True, False, False]
        for path, data in zip(paths[2:], saved[2:]):
            path.write_bytes(data)  # replayed
        assert node.lookup(NA, keys) == 2
        assert node.get(NA, keys)[2:] == [None, None]
        assert node.warm(NA, keys=keys).fetched == 0 and node.lookup(NA, keys, remote=False) == 2


def test_object_of_exactly_the_first_read_extended_is_a_miss(tmp_path: Path) -> None:
    """tier.py: an object longer than it states is corrupt (a miss). Not at exactly FIRST_READ_BYTES (8 MiB):
    read_object's first read fills its window, and _read_rest, with nothing left, never reads the byte past."""
    from ucm_db.remote.tier import FIRST_READ_BYTES

    key = NA.block_keys(list(range(4)))[0]
    overhead = ENVELOPE_BYTES + len(codec.encode(key, bytes(1), codec="none")) - 1
    block = bytes(FIRST_READ_BYTES - overhead)
    url = f"file://{tmp_path}/remote"
    with ucm_db.open(tmp_path / "w", capacity_bytes=CAP, codec="none", remote=url, remote_mode="write_through") as w:
        w.put(NA, [key], [block], parent=None)
    path = tmp_path / "remote" / NA.short_id / key[:1].hex() / key.hex()
    assert path.stat().st_size == FIRST_READ_BYTES  # the precondition: the object states exactly the first read
    with path.open("ab") as tail:
        tail.write(b"appended by whoever can write the remote")
    with ucm_db.open(tmp_path / "reader", capacity_bytes=CAP, remote=url, remote_deadline_s=5) as reader:
        assert reader.get(NA, [key]) == [None]
        assert reader.stats().remote["corrupt"] == 1


@pytest.mark.parametrize("damage", ["cut", "lengthened", "cut_in_head"])
def test_truncated_parent_object_is_uploaded_again_like_an_absent_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      damage: str) -> None:
    """remote.md (Uploads and gc): a batch root's parent found absent or broken that the local tier holds is
    uploaded again; ancestry.AncestorRepair._check: "present if it is whole". A parent object cut short or
    lengthened (an attacker, a partial copy) is not whole: readers miss it and all under it (corrupt). The check
    once read its envelope only and took it for present; it now also reads the object's stated end. With the
    parent deleted instead, the reader finds all 4, and so it must here."""
    keys, payloads = _chain(4, seed=2)
    keyed = {**Profile(("A1",)).options(tmp_path, "k", monkeypatch), "remote_deadline_s": 5}
    url = f"file://{tmp_path}/remote"
    with ucm_db.open(tmp_path / "node", capacity_bytes=CAP, remote=url, remote_mode="write_through", **keyed) as node:
        node.put(NA, keys[:3], payloads[:3])
    parent = tmp_path / "remote" / NA.short_id / keys[2][:1].hex() / keys[2].hex()
    whole = parent.read_bytes()
    parent.write_bytes({"cut": whole[: ENVELOPE_BYTES + 100], "lengthened": whole + b"\0",
                        "cut_in_head": whole[: ENVELOPE_BYTES + 3]}[damage])
    with ucm_db.open(tmp_path / "node", capacity_bytes=CAP, remote=url, remote_mode="write_through", **keyed) as node:
        node.put(NA, keys[3:], payloads[3:], parent=keys[2])
    assert parent.read_bytes() == whole
    with ucm_db.open(tmp_path / "reader", capacity_bytes=CAP, remote=url, **keyed) as reader:
        assert reader.lookup(NA, keys) == 4
