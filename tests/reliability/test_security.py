"""Security: no code execution from data, isolation, hostile paths, modes.

* A static scan of the shipped packages (ucm_db/, connector/, migrations/,
  tools/) for deserialisers that can run code (pickle, marshal, dill, shelve,
  ``torch.load``, ``numpy.load(allow_pickle=True)``, ``yaml.load``), for
  ``eval``/``exec``, and for rocksdict without ``raw_mode=True``.
* A pickle planted where a block is expected (local table, remote object,
  remote manifest) is never unpickled: reading it is a miss, and its payload
  (which would create a marker file) never runs.
* Namespace isolation: namespaces differing in any one field give different
  keys (every pair among ~1400 values per field: ~1e6 pairs per field) and
  a real store never serves one namespace's block to another.
* Hostile keys and remote listings (``../``, absolute paths, NUL, symlinks)
  never touch a file outside the roots.
* Store directories are 0700 and files 0600, whatever the umask.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import pickle
import stat
import time
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace
from ucm_db.errors import ConfigError

from .harness import NS, chain_tokens, payload_for

REPO = Path(__file__).resolve().parents[2]
SHIPPED = ("ucm_db", "connector", "migrations", "tools")
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "dill", "cloudpickle", "shelve", "joblib"}
FORBIDDEN_CALLS = {"eval", "exec"}  # __import__ of a constant name is an import, not a deserialiser


# -- static scan -----------------------------------------------------------------
def scan_source(source: str, name: str) -> list[str]:
    """Findings of one module's source (empty when clean)."""
    findings: list[str] = []
    tree = ast.parse(source, filename=name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            findings += [f"{name}:{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            findings.append(f"{name}:{node.lineno}: from {node.module} import")
        elif isinstance(node, ast.Call):
            findings += _call_findings(node, name)
    if "rocksdict" in source or "Rdict" in source:
        if "raw_mode=False" in source or ("Rdict(" in source and "raw_mode=True" not in source):
            findings.append(f"{name}: rocksdict used without raw_mode=True")
    return findings


def _call_findings(node: ast.Call, name: str) -> list[str]:
    func = node.func
    where = f"{name}:{node.lineno}"
    if isinstance(func, ast.Name) and func.id in FORBIDDEN_CALLS:
        return [f"{where}: {func.id}()"]
    if not isinstance(func, ast.Attribute):
        return []
    base = ast.unparse(func.value)
    keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
    if func.attr in ("load", "loads") and base in ("torch", "torch.jit"):
        return [f"{where}: {base}.{func.attr}()"]
    if func.attr == "load" and base in ("np", "numpy") and keywords.get("allow_pickle") == "True":
        return [f"{where}: numpy.load(allow_pickle=True)"]
    if func.attr in ("load", "load_all") and base == "yaml" and "SafeLoader" not in keywords.get("Loader", ""):
        return [f"{where}: yaml.{func.attr} without SafeLoader (use yaml.safe_load)"]
    if func.attr in ("loads", "load") and base in FORBIDDEN_MODULES:
        return [f"{where}: {base}.{func.attr}()"]
    return []


def test_scanner_catches_what_it_looks_for() -> None:
    bad = {
        "import pickle": 1, "from marshal import loads": 1, "eval('1')": 1, "exec('x=1')": 1,
        "torch.load(f)": 1, "np.load(f, allow_pickle=True)": 1, "yaml.load(s)": 1,
        "from rocksdict import Rdict\nRdict(p)": 1, "opts = Options(raw_mode=False)  # rocksdict": 1,
    }
    for source, expected in bad.items():
        assert len(scan_source(source, "planted.py")) == expected, source
    clean = "import json\nyaml.safe_load(s)\nnp.load(f)\nre.compile('x')\nRdict(p, options=Options(raw_mode=True))"
    assert scan_source(clean, "clean.py") == []


def test_shipped_packages_never_deserialise_code() -> None:
    files = [p for package in SHIPPED for p in sorted((REPO / package).rglob("*.py"))]
    assert len(files) > 20, "the scan must see the packages"
    findings = [f for path in files for f in scan_source(path.read_text(), str(path.relative_to(REPO)))]
    assert findings == []


# -- planted pickles ---------------------------------------------------------------
class _Exploit:
    """Unpickling this runs ``os.system('touch MARKER')``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_planted_pickles_are_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    exploit = pickle.dumps(_Exploit(marker))
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    options = {"remote": f"file://{remote_dir}", "capacity_bytes": 1 << 26}
    keys = NS.block_keys(chain_tokens("pickle", 3))
    with ucm_db.open(tmp_path / "store", **options) as store:
        root = store._wing.link.root  # type: ignore[union-attr]
        ns_id = NS.digest[:16]
        for key in keys:  # pickles where the remote objects should be
            path = Path(root.object_path(ns_id, key))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(exploit)
        manifest = Path(root.namespace_dir(ns_id)) / "manifest.json"
        manifest.write_bytes(exploit)
        assert store.get(NS, keys) == [None, None, None]
        assert store.lookup(NS, keys) == 0
        # ...and one in the local tier's block table.
        store.put(NS, keys[:1], [b"x" * 64])
        store._tier.engine.write(lambda txn: txn.put("blocks", keys[0], exploit))
        assert store.get(NS, keys[:1]) == [None]
    from click.testing import CliRunner

    from ucm_db.tools.cli import cli

    for args in (["inspect", str(tmp_path / "store")], ["verify", str(tmp_path / "store")]):
        CliRunner().invoke(cli, args)
    assert not marker.exists(), "a planted pickle was executed"


# -- namespace isolation -----------------------------------------------------------
VALUES_PER_FIELD = 1415  # C(1415, 2) ~ 1.0e6 pairs differing in that one field


def field_variants() -> dict[str, list[Namespace]]:
    base = {"model": "org/model", "kv_dtype": "bfloat16", "block_size": 16}
    n = VALUES_PER_FIELD
    return {
        "model": [Namespace(**{**base, "model": f"org/model-{i}"}) for i in range(n)],
        "kv_dtype": [Namespace(**{**base, "kv_dtype": f"dtype{i}"}) for i in range(n)],
        "block_size": [Namespace(**{**base, "block_size": i}) for i in range(1, n + 1)],
        "tp_rank": [Namespace(**base, tp_rank=i, tp_size=n) for i in range(n)],
        "tp_size": [Namespace(**base, tp_size=i) for i in range(1, n + 1)],
        "pp_rank": [Namespace(**base, pp_rank=i, pp_size=n) for i in range(n)],
        "layout": [Namespace(**base, layout=f"cpu:{i}x8x128") for i in range(n)],
        "key_scheme": [Namespace(**base, key_scheme=i) for i in range(n)],
        "extra": [Namespace(**base, extra=f"quant={i}") for i in range(n)],
    }


def test_namespaces_differing_in_one_field_never_share_keys() -> None:
    tokens = list(range(VALUES_PER_FIELD))  # one shared prefix; each takes its first block
    seen: set[bytes] = set()
    pairs = 0
    for name, variants in field_variants().items():
        keys = [ns.block_keys(tokens[: ns.block_size])[0] for ns in variants]
        assert len(set(keys)) == len(keys), f"namespaces differing only in {name} collide"
        pairs += len(keys) * (len(keys) - 1) // 2
        seen.update(keys)
    assert pairs >= 9_000_000
    print(f"\nnamespace isolation: {pairs} pairs differing in one field, {len(seen)} distinct keys, 0 collisions")


def test_store_never_serves_a_block_across_namespaces(tmp_path: Path) -> None:
    base = Namespace(model="org/model", kv_dtype="bfloat16", block_size=4, tp_size=2, pp_size=2)
    others = [
        Namespace(model="org/model2", kv_dtype="bfloat16", block_size=4, tp_size=2, pp_size=2),
        Namespace(model="org/model", kv_dtype="float16", block_size=4, tp_size=2, pp_size=2),
        Namespace(model="org/model", kv_dtype="bfloat16", block_size=4, tp_size=2, pp_size=2, tp_rank=1),
        Namespace(model="org/model", kv_dtype="bfloat16", block_size=4, tp_size=2, pp_size=2, pp_rank=1),
        Namespace(model="org/model", kv_dtype="bfloat16", block_size=4, tp_size=2, pp_size=2, layout="x"),
        Namespace(model="org/model", kv_dtype="bfloat16", block_size=4, tp_size=2, pp_size=2, extra="q"),
        Namespace(model="org/model", kv_dtype="bfloat16", block_size=4, tp_size=2, pp_size=2, key_scheme=2),
    ]
    tokens = list(range(64))
    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 26) as store:
        keys = base.block_keys(tokens)
        store.put(base, keys, [payload_for(k, 256) for k in keys])
        for other in others:
            other_keys = other.block_keys(tokens)
            assert store.lookup(other, other_keys) == 0
            assert store.get(other, other_keys) == [None] * len(other_keys)
        # Extras (LoRA, cache_salt) separate chains of one namespace too.
        salted = base.block_keys(tokens, {"cache_salt": "tenant-b"})
        assert store.lookup(base, salted) == 0
        assert store.lookup(base, keys) == len(keys)


# -- hostile keys and listings -----------------------------------------------------
HOSTILE_KEYS = [b"../../../../etc/passwd", b"/etc/passwd", b"a\0b", b"..", b"", b"x" * 31, b"x" * 33, "é".encode() * 20, b"x" * 600]


def test_hostile_keys_are_refused_before_any_io(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    before = sorted(os.listdir(tmp_path))
    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 26, remote=f"file://{tmp_path / 'remote'}") as store:
        for key in HOSTILE_KEYS:
            with pytest.raises(ConfigError):
                store.put(NS, [key], [b"x" * 64], parent=None)
            with pytest.raises(ConfigError):
                store.get(NS, [key])
            with pytest.raises(ConfigError):
                store.lookup(NS, [key])
            with pytest.raises(ConfigError):
                store.delete(NS, [key])
    assert os.listdir(outside) == []
    assert sorted(set(os.listdir(tmp_path)) - {"s", "remote"}) == before
    if (tmp_path / "remote").exists():
        assert [p for p in (tmp_path / "remote").rglob("*") if p.is_file() and "passwd" in p.name] == []


def test_hostile_remote_listing_never_touches_outside_files(tmp_path: Path) -> None:
    """Symlinks and odd names in a shared remote directory: reads are misses,
    writes replace the link (not its target), gc deletes no outside file."""
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret"
    secret.write_bytes(b"do not touch")
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    keys = NS.block_keys(chain_tokens("hostile", 2))
    with ucm_db.open(tmp_path / "s", capacity_bytes=1 << 26, remote=f"file://{remote_dir}", remote_mode="write_through") as store:
        root = store._wing.link.root  # type: ignore[union-attr]
        ns_dir = Path(root.namespace_dir(NS.digest[:16]))
        link = Path(root.object_path(NS.digest[:16], keys[0]))
        link.parent.mkdir(parents=True)
        link.symlink_to(secret)  # an object name pointing outside the root
        (ns_dir / "ab").mkdir(exist_ok=True)
        (ns_dir / "escape").symlink_to(outside, target_is_directory=True)  # a directory link out of the root
        (ns_dir / "ab" / ("f" * 64)).symlink_to(secret)
        assert store.get(NS, keys) == [None, None]  # the link's target is not a block
        store.put(NS, keys, [payload_for(k, 512) for k in keys])  # write-through replaces the link itself
        listed = set(store._wing.link.root.tier(NS.digest[:16]).iterate())  # type: ignore[union-attr]
        assert set(keys) <= listed
    assert secret.read_bytes() == b"do not touch"
    from ucm_db.remote.gc import gc
    from ucm_db.remote.tier import RemoteRoot

    gc(RemoteRoot.from_url(f"file://{remote_dir}"), older_than_s=0.0, max_bytes=None, dry_run=False, now_s=time.time() + 10)
    assert secret.read_bytes() == b"do not touch" and sorted(os.listdir(outside)) == ["secret"]


def test_memory_remote_listing_with_traversal_names_is_ignored(tmp_path: Path) -> None:
    """An object store can list any string: names with ../, absolute paths
    or NUL are not keys and are skipped."""
    from ucm_db.remote.tier import RemoteRoot

    root = RemoteRoot.from_url(f"memory://hostile-{os.getpid()}")
    ns_dir = root.namespace_dir(NS.digest[:16])
    for name in ("../../escape", "/abs/path", "a\0b", ".." + "0" * 62, "0" * 63 + "\0", "zz" * 32):
        root.fs.pipe_file(f"{ns_dir}/00/{name}", b"junk")
    assert list(root.tier(NS.digest[:16]).iterate()) == []


# -- file modes ----------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["lmdb", "rocksdb"])
def test_store_directories_are_0700_and_files_0600(tmp_path: Path, engine: str) -> None:
    if engine == "rocksdb":
        pytest.importorskip("rocksdict")
    store_path = tmp_path / "fresh" / "store"

    # A fresh interpreter, not a fork: forking a pytest process that has
    # opened RocksDB before (its background threads hold locks) can hang the child.
    code = (
        "import os, sys, ucm_db\n"
        "os.umask(0)\n"
        "ns = ucm_db.Namespace(model='modes', kv_dtype='bfloat16', block_size=4)\n"
        "with ucm_db.open(sys.argv[1], capacity_bytes=1 << 26, engine=sys.argv[2]) as store:\n"
        "    store.put(ns, ns.block_keys([1, 2, 3, 4]), [b'x' * 64])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(store_path), engine], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    bad = []
    for path in [store_path, *store_path.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        want = 0o700 if path.is_dir() else 0o600
        if mode & ~want:
            bad.append(f"{path.relative_to(store_path.parent)}: {oct(mode)}")
    if engine == "rocksdb":
        # RocksDB creates its files itself, with the process umask (0644 at
        # the usual 022): not fixable without a process-wide umask change.
        # They stay private because every directory above them is 0700.
        dirs_ok = all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in [store_path, *store_path.rglob("*")] if p.is_dir())
        assert dirs_ok, f"rocksdb: a directory is not 0700: {bad}"
        bad = [b for b in bad if not b.startswith("store/rocksdb/")]
    assert bad == [], f"{engine}: readable by others: {bad}"
