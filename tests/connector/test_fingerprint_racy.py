"""Git's "racy clean" rule in the fingerprint cache (connector/fingerprints.py):
a file changed within ``RACY_WINDOW_NS`` of its hash keeps a digest that is
never reused, so a write landing in the same timestamp tick as the hash (coarse
timestamps: one timer tick before Linux 6.13, a second or two on some file
systems; such a write leaves the stat as it was) cannot leave a stale digest
naming the model. Real files; the window is shortened to 0.2 s so the test
need not wait two seconds.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from ucm_db.connector import fingerprints  # noqa: E402
from ucm_db.connector.fingerprints import fingerprint  # noqa: E402

from test_identity_inputs import own_caches  # noqa: E402,F401 - autouse: each test its own fingerprint cache

WINDOW_NS = 200_000_000


@pytest.mark.parametrize("persisted", [False, True], ids=["memo", "cache-file"])
def test_a_digest_taken_right_after_a_write_is_never_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, persisted: bool,
) -> None:
    monkeypatch.setattr(fingerprints, "RACY_WINDOW_NS", WINDOW_NS)  # after own_caches' 0
    if persisted:
        monkeypatch.setattr(fingerprints, "PERSIST_MIN_BYTES", 1)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\1" * 8192)
    first = fingerprint(model)
    assert first.hashed_bytes == first.total_bytes > 0
    again = fingerprint(model)
    assert (again.digest, again.hashed_bytes) == (first.digest, again.total_bytes), "a racy digest was reused"
    time.sleep(2 * WINDOW_NS / 1e9)
    settled = fingerprint(model)  # hashed once more, now past the window: reusable from here on
    assert (settled.digest, settled.hashed_bytes) == (first.digest, settled.total_bytes)
    assert fingerprint(model).hashed_bytes == 0
