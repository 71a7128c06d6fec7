"""Review of two changes: the uploader's whole-parent check and ``dev.py test``'s two parts.

Parent check (``ucm_db.remote.object_reads.object_is_whole``, ``AncestorRepair._check``; docs/remote.md,
"Uploads and gc"): on every root (``file://``, ``memory://``, a moto S3 server, where a range at or past the
end answers 416) and every object kind (plain, signed, sealed, signed and sealed; seeded block sizes, the empty
block included), invariants:
    * a whole object is whole (never re-uploaded: it would go non-exclusively over another writer's object);
    * an object cut short (by 1 or 2 bytes, to its probe, inside its probe, to nothing) or lengthened by a byte
      is not whole, and a store writing a child under it puts the parent back, byte for byte.
Two parts (``dev.py`` ``splits`` / ``run_in_two_parts``; tests/conftest.py ``--part``): in a tiny tree with the
real conftest, every argument form that ``splits`` lets through must run like one pytest would (exit 0 where
each test passes), and the command's output must survive what a test writes.

The defects this review found (the docs' cost of a check, cache-plugin options and a log that is not UTF-8
failing the two parts, a debugger's prompt hanging the background part) are fixed; their tests stay. The partition
itself was checked by hand (each part's ``--collect-only`` against the whole suite's: together the whole, none in
both): too slow to repeat here.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random
import shutil
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import ucm_db
from ucm_db import Namespace, codec
from ucm_db.auth import AuthKeys
from ucm_db.remote.ancestry import AncestorRepair
from ucm_db.remote.envelope import PROBE_BYTES, pack_object
from ucm_db.remote.object_reads import object_is_whole
from ucm_db.remote.sealing import SealingKeys
from ucm_db.remote.tier import RemoteRoot

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "ucm-review-parts"
NS = Namespace(model="test/review-parent-checks", kv_dtype="bfloat16", block_size=4, layout="test")
CAP = 32 << 20
AUTH_SECRET, SEAL_SECRET = b"\x11" * 32, b"\x22" * 32
#: Object kinds by name: (signs, seals).
KINDS = {"plain": (False, False), "signed": (True, False), "sealed": (False, True), "both": (True, True)}
#: Raw block sizes, seeded per kind (0: the empty block, the smallest object there is).
SIZES_SEED = 7
ROOT_KINDS = ["file", "memory", pytest.param("s3", marks=pytest.mark.s3)]


def damaged(whole: bytes) -> dict[str, bytes]:
    """Every broken form of ``whole`` the check must see, by name."""
    return {"cut1": whole[:-1], "cut2": whole[:-2], "lengthened": whole + b"\0", "to_probe": whole[:PROBE_BYTES],
            "in_probe": whole[: PROBE_BYTES - 1], "empty": b""}


@pytest.fixture(scope="module")
def s3_endpoint_options() -> Iterator[dict[str, Any]]:
    """s3fs options for a moto server of this module, with one bucket."""
    import fsspec
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing", "anon": False,
               "config_kwargs": {"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}}}
    fsspec.filesystem("s3", skip_instance_cache=True, **options).mkdir(BUCKET)
    yield options
    server.stop()


def remote_url(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """A fresh root of ``kind``: its URL and fsspec options."""
    unique = uuid.uuid4().hex[:12]
    if kind == "file":
        return f"file://{tmp_path}/remote-{unique}", {}
    if kind == "memory":
        return f"memory://review-{unique}", {}
    return f"s3://{BUCKET}/{unique}", dict(request.getfixturevalue("s3_endpoint_options"))


def pack(key: bytes, raw: bytes, signs: bool, seals: bool) -> bytes:
    """A real object of ``raw`` under ``key`` (one frame, no parent)."""
    blob = codec.encode(key, raw, element_bytes=1)
    return pack_object(key, None, NS.id, blob, AuthKeys((AUTH_SECRET,), "review") if signs else None,
                       SealingKeys((SEAL_SECRET,), "review") if seals else None)


@pytest.mark.parametrize("root_kind", ROOT_KINDS)
def test_whole_objects_are_whole_and_broken_ones_are_not(root_kind: str, tmp_path: Path,
                                                         request: pytest.FixtureRequest) -> None:
    url, options = remote_url(root_kind, tmp_path, request)
    root = RemoteRoot.from_url(url, options)
    rng = random.Random(SIZES_SEED)
    key = NS.block_keys(list(range(4)))[0]
    path = root.object_path(NS.id, key)
    root.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    for kind, (signs, seals) in KINDS.items():
        for raw_len in (0, 1, rng.randrange(2, 300), rng.randrange(300, 9000)):
            whole = pack(key, rng.randbytes(raw_len), signs, seals)
            for name, data in {"whole": whole, **damaged(whole)}.items():
                root.fs.pipe_file(path, data)
                first = root.read_range(path, 0, PROBE_BYTES)
                assert first is not None
                assert object_is_whole(root, path, key, first, PROBE_BYTES) is (name == "whole"), (kind, raw_len, name)


def store_options(url: str, options: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """A signing and sealing write-through store's options over ``url``."""
    for name, secret in (("auth.key", AUTH_SECRET), ("seal.key", SEAL_SECRET)):
        (tmp_path / name).write_text(secret.hex() + "\n")
        (tmp_path / name).chmod(0o600)
    return {"capacity_bytes": CAP, "remote": url, "remote_options": options, "remote_mode": "write_through",
            "remote_auth_key_file": str(tmp_path / "auth.key"),
            "remote_encryption_key_file": str(tmp_path / "seal.key"), "remote_deadline_s": 10}


def put_child_over(tmp_path: Path, url: str, options: dict[str, Any],
                   damage: str) -> tuple[bytes, bytes, dict[str, Any]]:
    """Puts 3 blocks, damages the third's object, reopens and puts a 4th under it: the third's object before and
    after, and the second session's remote stats."""
    rng = random.Random(3)
    keys = NS.block_keys([rng.randrange(50_000) for _ in range(16)])
    payloads = [rng.randbytes(2048) for _ in keys]
    opts = store_options(url, options, tmp_path)
    with ucm_db.open(tmp_path / "node", **opts) as node:
        node.put(NS, keys[:3], payloads[:3])
    root = RemoteRoot.from_url(url, options)
    path = root.object_path(NS.id, keys[2])
    whole = root.fs.cat_file(path)
    root.fs.pipe_file(path, whole if damage == "whole" else damaged(whole)[damage])
    with ucm_db.open(tmp_path / "node", **opts) as node:
        node.put(NS, keys[3:], payloads[3:], parent=keys[2])
        stats = node.stats().remote
    return whole, root.fs.cat_file(path), stats


@pytest.mark.parametrize("root_kind", ROOT_KINDS)
@pytest.mark.parametrize("damage", ["whole", "cut1", "lengthened"])
def test_a_child_put_leaves_a_whole_parent_and_replaces_a_broken_one(root_kind: str, damage: str, tmp_path: Path,
                                                                     request: pytest.FixtureRequest) -> None:
    """Sealed objects carry a random nonce: a whole parent uploaded again would differ from the one first put; a
    broken one is put back whole (as long as it was, a fresh nonce)."""
    url, options = remote_url(root_kind, tmp_path, request)
    before, after, stats = put_child_over(tmp_path, url, options, damage)
    assert after == before if damage == "whole" else (len(after) == len(before) and after != before)
    assert stats["ancestors_reuploaded"] == (0 if damage == "whole" else 1), stats
    assert stats["ancestor_checks"] == 1 or damage != "whole", stats  # a broken one's ancestors are checked too


def test_a_present_parent_costs_the_two_requests_the_docs_state(tmp_path: Path) -> None:
    """ancestry.py (Cost per batch) and docs/remote.md (Cost): a present parent's check is two ranged reads."""
    assert "two requests per distinct batch-root parent" in (ROOT / "ucm_db" / "remote" / "ancestry.py").read_text()
    assert "two ranged GETs per batch root" in (ROOT / "docs" / "remote.md").read_text()
    url = f"file://{tmp_path}/remote"
    key = NS.block_keys([1, 2, 3, 4])[0]
    root = RemoteRoot.from_url(url)
    path = root.object_path(NS.id, key)
    root.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    root.fs.pipe_file(path, pack(key, b"x" * 500, False, False))
    # _check reads the remote only: no local tier, upload nor pool is used.
    repair = AncestorRepair(None, root, upload=lambda item, tier: None,  # type: ignore[arg-type]
                            run=lambda calls: [call() for call in calls])
    present: dict[bytes, bool] = {}
    before = root.stats.requests
    assert repair._check(key, NS.id, present, set(), set()) is None and present[key]
    assert root.stats.requests - before == 2


# -- dev.py test: two parts -----------------------------------------------------------------------------------


def load_dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dev_under_review", ROOT / "dev.py")
    assert spec is not None and spec.loader is not None
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    return dev


def tiny_tree(tmp_path: Path, first_part_body: str = "pass") -> Path:
    """tests/ with the real conftest, one passing test under tests/vllm (body ``first_part_body``), one plain."""
    (tmp_path / "tests" / "vllm").mkdir(parents=True)
    shutil.copyfile(ROOT / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    engine_test = f"import os\n\n\ndef test_engine():\n    {first_part_body}\n"
    (tmp_path / "tests" / "vllm" / "test_engine.py").write_text(engine_test)
    (tmp_path / "tests" / "test_plain.py").write_text("def test_plain():\n    pass\n")
    return tmp_path


def run_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], first_part_body: str = "pass") -> int:
    dev = load_dev()
    assert dev.splits(args), args  # the forms below are all ones dev.py runs in two parts
    monkeypatch.setattr(dev, "ROOT", tiny_tree(tmp_path, first_part_body))
    monkeypatch.setattr(dev, "PY", Path(sys.executable))
    return int(dev.run_in_two_parts(args, dict(os.environ)))


def test_the_two_parts_pass_where_every_test_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_parts(tmp_path, monkeypatch, ["-q"]) == 0


@pytest.mark.parametrize("option", ["--ff", "--nf", "--cache-clear"])
def test_options_of_the_cache_plugin_run_in_two_parts(option: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capfd: pytest.CaptureFixture[str]) -> None:
    code = run_parts(tmp_path, monkeypatch, ["-q", option])
    assert code == 0, capfd.readouterr().out[-2000:]


def test_a_part_1_log_that_is_not_utf8_is_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw_bytes = "os.write(1, b'\\xff\\xfe raw\\n')"
    assert run_parts(tmp_path, monkeypatch, ["-q", "-s"], first_part_body=raw_bytes) == 0


@pytest.mark.parametrize("option", ["--pdb", "--trace"])
def test_an_interactive_debugger_runs_one_pytest(option: str) -> None:
    assert load_dev().splits([option]) is False
