"""The child of tests/test_review_processes_fuzz.py: a seeded random mix of store calls on one LMDB store.

``python review_processes_child.py CONFIG_JSON`` opens the store (``path``, ``options``; sometimes none: the
recorded ones) and runs ``ops`` operations drawn by ``seed``: put (a chain segment whose parent is stored,
payloads derived from each key), get, get_into (buffers with room to spare, or ScatterSlabs of one key's
size), lookup, lookup_many, delete, quarantine (with and without recheck), pin/unpin, flush, close/reopen,
and ``flap`` (cuts a long chain or puts it back). It reports on stdout, one line each, flushed: an intent
before every call that may change the store (``putgo``, ``delgo``, ``qgo``, ``pingo``, ``unpingo``) and an
acknowledgement once it returned (``put``, ``del``, ``q``, ``pin``, ``unpin``, ``flush``, ``reopen``), so the
parent can SIGKILL it anywhere and still keep a model (each line is one write under PIPE_BUF: whole or
absent). A check that fails here is a ``bad`` line: wrong bytes; a block of another size read into slabs;
get_into writing past a block; one lookup_many snapshot out of order; the long chain's prefix at a count no
commit leaves (without eviction). An unexpected exception is an ``error`` line and exit 2. It ends with
``done`` and exit 0.

Keys form a tree (``BRANCHES`` variants per depth, ``DEPTH`` deep): a path of variants names a chain, and
``payload(key)`` is the only right content of a key, so anyone can check bytes without a shared model.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import traceback
from typing import Any

import ucm_db

NS = ucm_db.Namespace(model="review-processes", kv_dtype="bfloat16", block_size=4)
BRANCHES, DEPTH = 3, 4
MIN_BYTES, STEP_BYTES, SIZES = 8192, 8192, 13
SENTINEL = 0xEE
#: A long chain beside the tree, of small blocks, that ``flap`` cuts at ``CUTS`` and puts back whole or from a
#: cut: every commit leaves its stored prefix at 0, a cut or whole, so one snapshot (a lookup) sees no other.
LONG_BLOCKS, CUTS = 48, (12, 24, 36)
LONG = NS.block_keys([1000 + i // NS.block_size for i in range(LONG_BLOCKS * NS.block_size)])
LONG_SET = frozenset(LONG)


def chain(path: list[int] | tuple[int, ...]) -> ucm_db.BlockKeys:
    """The keys of a path of variants (one block per depth)."""
    return NS.block_keys([t for d, v in enumerate(path) for t in [d * 8 + v + 1] * NS.block_size])


def size_of(key: bytes) -> int:
    if key in LONG_SET:
        return 512 + key[0] % 4 * 128
    return MIN_BYTES + (int.from_bytes(key[:2], "big") % SIZES) * STEP_BYTES


def payload(key: bytes) -> bytes:
    """A key's only right content: incompressible bytes derived from the key."""
    return hashlib.shake_256(b"review-processes/" + key).digest(size_of(key))


def random_path(rng: random.Random, min_depth: int = 1) -> list[int]:
    return [rng.randrange(BRANCHES) for _ in range(rng.randint(min_depth, DEPTH))]


class Child:
    """One child's store and its random operations."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg["seed"])
        self.pinned: list[ucm_db.BlockKeys] = []
        self.store = self.open()

    def open(self) -> ucm_db.Store:
        options = self.cfg["options"] if self.rng.random() < 0.7 else {}  # {}: the recorded settings
        return ucm_db.open(self.cfg["path"], **options)

    def say(self, *words: str) -> None:
        sys.stdout.write(" ".join(words) + "\n")
        sys.stdout.flush()

    def bad(self, what: str) -> None:
        self.say("bad", what.replace("\n", " "))

    def check_bytes(self, op: str, key: bytes, got: bytes | None) -> None:
        if got is not None and got != payload(key):
            self.bad(f"{op} {key.hex()[:16]} returned {len(got)} bytes that are not its payload")

    def put(self) -> None:
        keys = chain(random_path(self.rng))
        segment = keys[self.rng.randrange(len(keys)):]
        self.say("putgo", *(k.hex() for k in segment))
        try:
            self.store.put(NS, segment, [payload(k) for k in segment])
        except (ucm_db.MissingAncestorError, ucm_db.StoreFullError) as exc:
            self.say("putno", type(exc).__name__)
            return
        self.say("put", *(k.hex() for k in keys))  # the segment and its stored ancestors

    def get(self) -> None:
        keys = chain(random_path(self.rng))
        for key, got in zip(keys, self.store.get(NS, keys)):
            self.check_bytes("get", key, None if got is None else bytes(got))
        self.say("got")

    def get_into(self) -> None:
        keys = chain(random_path(self.rng))
        if self.rng.random() < 0.3:
            self.get_into_slabs(keys)
            return
        spare = self.rng.choice((0, 0, 1000))  # room to spare: the tail must stay as it was
        buffers = [bytearray([SENTINEL]) * (size_of(k) + spare) for k in keys]
        flags = self.store.get_into(NS, keys, buffers)
        for key, flag, buf in zip(keys, flags, buffers):
            if flag:
                self.check_bytes("get_into", key, bytes(buf[: size_of(key)]))
                if any(b != SENTINEL for b in buf[size_of(key):]):
                    self.bad(f"get_into {key.hex()[:16]} wrote past the block's bytes")
        self.say("gotinto")

    def get_into_slabs(self, keys: list[bytes]) -> None:
        """Slabs of one key's size: a block of another size must be a miss (docs/api.md), never a part."""
        slab = size_of(self.rng.choice(keys))
        view = bytearray([SENTINEL]) * (slab * len(keys))
        flags = self.store.get_into(NS, keys, ucm_db.ScatterSlabs([view], [slab], list(range(len(keys)))))
        for i, (key, flag) in enumerate(zip(keys, flags)):
            if flag and size_of(key) != slab:
                self.bad(f"get_into slabs of {slab} bytes took {key.hex()[:16]} of {size_of(key)} bytes")
            elif flag:
                self.check_bytes("get_into slabs", key, bytes(view[i * slab: (i + 1) * slab]))
        self.say("gotslabs")

    def flap(self) -> None:
        """Cuts the long chain at a cut or puts it back; then its prefix must read as 0, a cut or whole
        (without eviction, which takes tails block by block)."""
        r, cut = self.rng.random(), self.rng.choice(CUTS)
        if r < 0.6:
            segment = LONG if r < 0.3 else LONG[cut:]
            self.say("putgo", *(k.hex() for k in segment))
            try:
                self.store.put(NS, segment, [payload(k) for k in segment])
                self.say("put", *(k.hex() for k in LONG))
            except (ucm_db.MissingAncestorError, ucm_db.StoreFullError) as exc:
                self.say("putno", type(exc).__name__)
        else:
            self.say("delgo", LONG[cut].hex())
            self.say("del", str(self.store.delete(NS, [LONG[cut]])))
        n = self.store.lookup(NS, LONG, remote=False)
        k = self.rng.randint(1, LONG_BLOCKS)
        full, part = self.store.lookup_many(NS, [LONG, LONG[:k]])
        if part != min(full, k):
            self.bad(f"lookup_many one snapshot: long chain {full}, its first {k}: {part}")
        if not self.cfg["evicting"] and not {n, full} <= {0, *CUTS, LONG_BLOCKS}:
            self.bad(f"the long chain's prefix read {n} and {full}: no commit left it there")
        self.say("flapped", str(n))

    def lookups(self) -> None:
        path = random_path(self.rng, DEPTH)
        keys = chain(path)
        n = self.store.lookup(NS, keys, remote=False)
        if not 0 <= n <= len(keys):
            self.bad(f"lookup {n} of {len(keys)} keys")
        cut = self.rng.randint(1, len(keys))
        other = chain(path[: cut - 1] + [(path[cut - 1] + 1) % BRANCHES])
        full, prefix, sibling = self.store.lookup_many(NS, [keys, keys[:cut], other])
        if prefix != min(full, cut) or min(sibling, cut - 1) != min(full, cut - 1):
            self.bad(f"lookup_many one snapshot: chain {full}, its first {cut}: {prefix}, sibling {sibling}")
        self.say("looked", str(n))

    def delete(self) -> None:
        key = chain(random_path(self.rng, 3))[-1]
        self.say("delgo", key.hex())
        self.say("del", str(self.store.delete(NS, [key])))

    def quarantine(self) -> None:
        key = chain(random_path(self.rng, 2))[-1]
        recheck = self.rng.random() < 0.5
        self.say("qgo", key.hex(), str(int(recheck)))
        filed = self.store.quarantine(key, "review", recheck=recheck)  # recheck: a readable block stays
        self.say("q", str(int(filed)))

    def pin(self) -> None:
        keys = chain(random_path(self.rng))
        self.say("pingo", keys[-1].hex())
        try:
            report = self.store.pin(NS, keys)
        except ucm_db.StoreFullError:
            self.say("pinno")
            return
        self.pinned.append(keys)
        self.say("pin", keys[-1].hex(), *(k.hex() for k in keys[: report.chains[0]]))

    def unpin(self) -> None:
        if not self.pinned:
            return
        keys = self.pinned.pop(self.rng.randrange(len(self.pinned)))
        self.say("unpingo", keys[-1].hex())
        self.store.unpin(NS, keys)
        self.say("unpin")

    def flush(self) -> None:
        self.store.flush()
        self.say("flush")

    def reopen(self) -> None:
        self.store.close()
        self.store = self.open()
        self.say("reopen")

    def run(self) -> None:
        ops = [(self.put, 44), (self.get, 14), (self.get_into, 10), (self.lookups, 10), (self.delete, 4),
               (self.quarantine, 4), (self.pin, 5), (self.unpin, 4), (self.flush, 3), (self.reopen, 2), (self.flap, 8)]
        calls, weights = zip(*ops)
        self.say("ready")
        for _ in range(self.cfg["ops"]):
            self.rng.choices(calls, weights)[0]()
        self.store.close()
        self.say("done")


def main() -> int:
    cfg = json.loads(sys.argv[1])
    try:
        Child(cfg).run()
    except Exception as exc:  # noqa: BLE001 - every unexpected error is the parent's failure
        traceback.print_exc()
        sys.stdout.write(f"error {type(exc).__name__}: {str(exc)[:300]!r}\n")
        sys.stdout.flush()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
