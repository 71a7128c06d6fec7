"""Audit of the commit process's wire (ucm_db.committer.wire) with real
child processes: the child that runs is the parent's own code, and one
speaking another version is refused before it is sent anything; a frame
cut short, too long, or carrying nothing decodable ends the child without
a commit; nothing on the wire is unpickled or evaluated.

Findings reproduced here:
    * A PUT whose payload was not JSON ended the child (its parse ran
      outside the answer's try), though a failed request is to be
      answered and the loop to go on.
    * The child ran as ``python -m ucm_db.committer.child`` from the
      caller's working directory, which ``-m`` puts first on ``sys.path``:
      a ``ucm_db`` there (another checkout, another version) ran as the
      child, and nothing checked it spoke the parent's messages.
"""

from __future__ import annotations

import ast
import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ucm_db
from ucm_db.committer import CommitProcess, SharedChain, wire
from ucm_db.errors import CommitProcessError

NS = ucm_db.Namespace(model="audit-committer-wire", kv_dtype="bfloat16", block_size=4)
OPTIONS = {"capacity_bytes": 8 << 20, "codec": "none"}
UNIT_BYTES = 4096
COMMITTER = Path(ucm_db.__file__).parent / "committer"


def _shadow(root: Path) -> Path:
    """A ``ucm_db`` package under ``root`` whose commit child only leaves a mark."""
    (root / "ucm_db" / "committer").mkdir(parents=True)
    (root / "ucm_db" / "__init__.py").write_text("")
    (root / "ucm_db" / "committer" / "__init__.py").write_text("")
    mark = root / "shadow-ran"
    (root / "ucm_db" / "committer" / "child.py").write_text(f"open({str(mark)!r}, 'w').close()\n")
    return mark


def test_a_ucm_db_in_the_working_directory_never_runs_as_the_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mark = _shadow(tmp_path / "checkout")
    monkeypatch.chdir(tmp_path / "checkout")
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store, CommitProcess(tmp_path / "s", OPTIONS) as committer:
        assert not mark.exists(), "the working directory's ucm_db ran as the commit process"
        buffer = committer.share(UNIT_BYTES)
        keys = NS.block_keys([1, 2, 3, 4])
        np.frombuffer(buffer.memory, dtype=np.uint8)[:] = 7
        committer.put_segments(NS, [SharedChain(keys, buffer.id, 0, UNIT_BYTES, UNIT_BYTES)])
        assert [bytes(g) for g in store.get(NS, list(keys))] == [bytes([7]) * UNIT_BYTES]  # type: ignore[arg-type]


def test_a_child_of_another_version_is_refused_at_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The parent's side changed (as after an upgrade in place): the child, freshly imported, answers its own identity.
    monkeypatch.setattr(wire, "IDENTITY", '{"wire":0}', raising=False)
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store:
        with pytest.raises(CommitProcessError, match="other ucm-db code"):
            CommitProcess(tmp_path / "s", OPTIONS)
        assert store.stats().namespaces == {}


def _raw_child(tmp_path: Path) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """A commit child opened on a store, driven by hand over its socket."""
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-m", "ucm_db.committer.child", str(theirs.fileno())], pass_fds=[theirs.fileno()])
    theirs.close()
    wire.send_json(ours, wire.OPEN, {"path": str(tmp_path / "s"), "options": OPTIONS, "cpus": []})
    assert wire.receive_reply(ours).status == wire.OK
    return child, ours


@pytest.mark.parametrize("frame", ["cut", "too_long", "not_json"])
def test_a_bad_frame_ends_the_child_and_commits_nothing(tmp_path: Path, frame: str) -> None:
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store:
        child, sock = _raw_child(tmp_path)
        memfd = os.memfd_create("audit")
        os.ftruncate(memfd, UNIT_BYTES)
        wire.send_json(sock, wire.MAP, {"id": 1, "nbytes": UNIT_BYTES}, memfd)
        os.close(memfd)
        keys = NS.block_keys([1, 2, 3, 4])
        body = wire.json.dumps({"ns": NS.to_dict(), "codec": None, "frame_bytes": None, "events": None,
                                "chains": [{"keys": [k.hex() for k in keys], "parent": None, "buf": 1, "offset": 0,
                                            "stride": UNIT_BYTES, "unit_bytes": UNIT_BYTES}]}).encode()
        if frame == "cut":  # the head promises more than comes before the socket closes
            sock.sendall(wire._HEAD.pack(wire.PUT, len(body)) + body[:-10])
            sock.shutdown(socket.SHUT_WR)
        elif frame == "too_long":
            sock.sendall(wire._HEAD.pack(wire.PUT, wire.MAX_PAYLOAD_BYTES + 1) + body)
        else:  # the payload of another version: not this one's JSON
            sock.sendall(wire._HEAD.pack(wire.PUT, len(body)) + body[::-1])
        if frame == "not_json":  # answered as failed, and the child serves on (module invariants of child.py)
            assert wire.receive_reply(sock).status == wire.FAILED
            wire.send(sock, wire.CLOSE)
        assert child.wait(timeout=60) == 0
        sock.close()
        assert store.get(NS, list(keys)) == [None]


def test_nothing_on_the_wire_is_unpickled_or_evaluated() -> None:
    for path in COMMITTER.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
        assert not {"eval", "exec"} & names, path
        assert not {"pickle", "marshal", "shelve", "dill", "cloudpickle"} & imported, path


def test_stored_key_positions_of_another_reply_never_name_keys_outside_the_put() -> None:
    sent = [hashlib.blake2b(bytes([i]), digest_size=32).digest() for i in range(4)]
    reply = wire.Reply(wire.OK, 0.0, 0.0, wire.pack_stored_keys(sent, sent[2:]))
    assert wire.stored_keys(sent, reply) == sent[2:]
