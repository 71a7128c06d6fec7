"""A flush that times out because another process is the store directory's
uploader says so, and names it; it used to blame the remote ("check the
remote") while the remote was fine and the uploader elsewhere was stuck.

Real parts: two processes on one store directory (LMDB), the uploader
election (``uploader.lock``), moto's S3 server, and the stalling proxy of
:mod:`tests.remote.test_close_bounded` in front of it for the uploader that
gets stuck.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ucm_db
from ucm_db.errors import UploaderElsewhereError

from .conftest import BUCKET, chain, s3_options
from .test_close_bounded import CAP, CHILD, StallingEndpoint, endpoint, hanging_options  # noqa: F401 - fixture

pytestmark = [pytest.mark.timeout(240), pytest.mark.s3]


def test_flush_names_the_process_that_holds_the_election(
    endpoint: StallingEndpoint, s3_endpoint: str, tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    """Process A is the uploader (it uploaded its chain) and gets stuck (its
    endpoint stops answering mid-upload). This process, whose remote
    answers, puts and flushes: the error names A's pid and does not blame
    the remote. A killed, this process becomes the uploader and drains
    everything, A's leftovers included."""
    url = f"s3://{BUCKET}/elected-{tmp_path.name}"
    spec = {"store": str(tmp_path / "a"), "cap": CAP, "remote": url, "options": hanging_options(endpoint),
            "namespace": namespace.to_dict()}
    other = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(spec), str(Path(__file__).parent)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert other.stdout is not None and other.stdin is not None
        assert other.stdout.readline().strip() == "FLUSHED"  # A uploaded: A is the uploader
        endpoint.stall()
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "PUT"
        assert endpoint.wait_for_swallowed_put(30)  # A's upload hangs
        keys, payloads = chain(namespace, 6, seed=1)
        options = s3_options(s3_endpoint)
        with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=url, remote_options=options) as b:
            b.put(namespace, keys, payloads)
            with pytest.raises(UploaderElsewhereError) as raised:
                b.flush(upload_timeout_s=2)
            text = str(raised.value)
            assert f"process {other.pid} holds" in text and "still waiting for upload" in text, text
            assert "check the remote" not in text
            os.kill(other.pid, signal.SIGKILL)
            other.wait()
            b.flush(upload_timeout_s=60)  # the election passes here; A's queued continuation goes too
        with ucm_db.open(tmp_path / "reader", capacity_bytes=CAP, remote=url, remote_options=options,
                         remote_deadline_s=10) as reader:
            assert reader.get(namespace, keys) == payloads
            first, first_payloads = chain(namespace, 4)
            assert reader.get(namespace, first) == first_payloads
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()


def test_flush_names_a_closed_store_of_this_process_still_holding_the_election(
    endpoint: StallingEndpoint, s3_endpoint: str, tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    """A store closed while its upload hangs keeps the election in this
    process (a retraction must not be confirmed under that upload): the
    store opened again says that is what its flush waits for; once the hung
    call ends (the endpoint's connections drop), it uploads."""
    keys, payloads = chain(namespace, 4)
    url = f"s3://{BUCKET}/reopened-{tmp_path.name}"
    first = ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=url, remote_options=hanging_options(endpoint),
                        remote_mode="write_back")
    try:
        first.put(namespace, keys[:2], payloads[:2])
        first.flush(upload_timeout_s=30)
        endpoint.stall()
        first.put(namespace, keys[2:], payloads[2:], parent=keys[1])
        assert endpoint.wait_for_swallowed_put(30)
    finally:
        first.close()
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=url, remote_options=s3_options(s3_endpoint)) as again:
        with pytest.raises(UploaderElsewhereError, match="another store of this directory in this process"):
            again.flush(upload_timeout_s=1.5)
        endpoint.close()  # the hung request fails: the closed store's last call ends and lets the election go
        again.flush(upload_timeout_s=60)
