"""Warming from a remote with stray entries and broken manifests (issue 14
item 13): one bad entry never hides the other namespaces.

A real ``file://`` remote holds three namespaces; then a stray directory
with a 16-character non-hex name, one with a long name and a stray file
appear beside them, one namespace's ``manifest.json`` is overwritten with
garbage and another's replaced by a FIFO. Finding and warming the intact
namespace works through the Python API and through the ``ucm-db warm``
command (a real process); the bad entries are reported (warnings, and
``problems``), asking for a skipped namespace is a ConfigError naming it,
and the next upload into the garbage-manifest namespace rewrites it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db.errors import ConfigError
from ucm_db.keys import Namespace
from ucm_db.remote.warming import remote_namespaces

from .conftest import chain

pytestmark = pytest.mark.timeout(120)
CAP = 64 << 20
NS_A = Namespace(model="test/alpha", kv_dtype="bfloat16", block_size=4, layout="test")
NS_B = Namespace(model="test/beta", kv_dtype="bfloat16", block_size=4, layout="test")
NS_C = Namespace(model="test/gamma", kv_dtype="bfloat16", block_size=4, layout="test")
#: Two stray directories (one of a namespace's length) and a stray file.
STRAY = ("notahexnamespace", "zz-some-other-tool-dir", "README")


def hostile_remote(tmp_path: Path) -> tuple[str, Path, dict[str, Any]]:
    """A file:// remote with three namespaces, then stray entries, a garbage
    manifest (NS_B) and a FIFO manifest (NS_C); returns the url, its
    directory and NS_A's chains."""
    remote_dir = tmp_path / "remote"
    url = f"file://{remote_dir}"
    tokens = [[(11 * p + i) % 30000 for i in range(NS_A.block_size * 5)] for p in range(3)]
    with ucm_db.open(tmp_path / "writer", capacity_bytes=CAP, remote=url, remote_mode="write_through") as store:
        for ns in (NS_A, NS_B, NS_C):
            for seq in tokens:
                keys = ns.block_keys(seq)
                store.put(ns, keys, [bytes([p % 251]) * 512 + key for p, key in enumerate(keys)])
    for name in STRAY[:2]:
        (remote_dir / name).mkdir()
        (remote_dir / name / "data").write_bytes(b"not ucm-db")
    (remote_dir / STRAY[2]).write_text("notes someone left")
    (remote_dir / NS_B.short_id / "manifest.json").write_bytes(b"{truncated by a full disk")
    fifo = remote_dir / NS_C.short_id / "manifest.json"
    fifo.unlink()
    os.mkfifo(fifo)
    return url, remote_dir, {"tokens": tokens}


def test_python_api_skips_bad_entries_and_warms_the_rest(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url, remote_dir, seeded = hostile_remote(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ucm_db"):
        found = remote_namespaces(url)
    assert found.namespaces == {NS_A.short_id: NS_A}
    text = "\n".join(found.problems)
    for name in STRAY:
        assert name in text
    assert f"{NS_B.short_id}/manifest.json is not JSON" in text
    assert f"{NS_C.short_id}/manifest.json is unreadable" in text and "FIFO" in text
    assert len(found.problems) == len(STRAY) + 2
    assert all(p.split(": ", 1)[-1] in caplog.text or p in caplog.text for p in found.problems), "each problem is logged"

    assert found.find("test/alpha") == NS_A
    assert found.find(NS_A.short_id[:6]) == NS_A
    with pytest.raises(ConfigError) as refused:
        found.find("test/beta")
    assert "0 namespaces" in str(refused.value) and f"{NS_B.short_id}/manifest.json" in str(refused.value)
    assert refused.value.hint

    with ucm_db.open(tmp_path / "fresh", capacity_bytes=CAP, remote=url) as store:
        report = store.warm(found.find("test/alpha"), token_sequences=seeded["tokens"])
        assert (report.fetched, report.missing) == (15, 0)
        keys = NS_A.block_keys(seeded["tokens"][0])
        assert store.get(NS_A, keys) == [bytes([p % 251]) * 512 + key for p, key in enumerate(keys)]


def test_an_upload_rewrites_a_broken_manifest(tmp_path: Path) -> None:
    url, remote_dir, _ = hostile_remote(tmp_path)
    keys, payloads = chain(NS_B, 3, seed=9)
    with ucm_db.open(tmp_path / "other-writer", capacity_bytes=CAP, remote=url) as store:
        store.put(NS_B, keys, payloads)
        store.flush(upload_timeout_s=30)  # the broken manifest must not block the uploads
        assert store.stats().pending_uploads == 0
    manifest = json.loads((remote_dir / NS_B.short_id / "manifest.json").read_bytes())
    assert manifest["namespace"] == NS_B.to_dict()
    assert set(remote_namespaces(url).namespaces) == {NS_A.short_id, NS_B.short_id}


def test_cli_warm_skips_bad_entries_with_a_warning(tmp_path: Path) -> None:
    """``ucm-db warm`` as a real process: exit 0, the intact namespace
    warmed, the skipped entries named on stderr."""
    url, _remote_dir, seeded = hostile_remote(tmp_path)
    tokens_file = tmp_path / "prompts.jsonl"
    tokens_file.write_text("\n".join(json.dumps(t) for t in seeded["tokens"]))
    cli = Path(sys.executable).with_name("ucm-db")
    proc = subprocess.run([str(cli), "warm", str(tmp_path / "node"), "--remote", url, "--namespace", "test/alpha",
                           "--tokens", str(tokens_file), "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["fetched"] == 15
    for name in (*STRAY, f"{NS_B.short_id}/manifest.json", f"{NS_C.short_id}/manifest.json"):
        assert name in proc.stderr, proc.stderr
    with ucm_db.open(tmp_path / "node") as store:
        assert store._tier.count_prefix(NS_A.block_keys(seeded["tokens"][2])) == 5
