"""A process whose remote stops answering still exits once it has closed
its store, leaving what it could not upload queued for the next uploader.

The issue: ``close`` already returned at once while an upload hung, but
the remote pools ran on ``concurrent.futures`` threads, which the
interpreter joins at exit: a process that had closed its store and
returned from its main never exited (it had to be killed). Now those pools
run on daemon threads (``ucm_db/remote/daemon_pool.py``), the close logs
what it abandons, and the election stays with the process until it exits
(the kernel lets the flock go with it, and the abandoned call dies with it).

Everything is real: moto's S3 server behind :class:`StallingEndpoint`, a
TCP proxy that at a given moment stops forwarding anything on every
connection, open or new (it still accepts and reads): an S3 endpoint, or a
mount, that stops answering. The client's read timeout is an hour, so the
hung request stays hung for the whole test.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ucm_db

from .conftest import BUCKET, chain, s3_options

pytestmark = [pytest.mark.timeout(240), pytest.mark.s3]
CAP = 64 << 20
#: Generous bound on a process's exit after its close (it exits at once; a hang is what this catches).
EXIT_WAIT_S = 60.0


class StallingEndpoint:
    """A TCP proxy to ``upstream`` (``http://host:port``) that forwards
    until :meth:`stall`, then forwards nothing more, on any connection."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self._upstream = (host, int(port))
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self.stalled, self.closed = threading.Event(), threading.Event()
        self.swallowed_puts = 0  # PUT requests received after the stall (never forwarded)
        self._sockets: list[socket.socket] = [self._server]
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self) -> None:
        self.stalled.set()

    def wait_for_swallowed_put(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while self.swallowed_puts == 0 and time.monotonic() < end:
            time.sleep(0.02)
        return self.swallowed_puts > 0

    def close(self) -> None:
        """Stops listening and drops every connection (its peers see them closed)."""
        self.closed.set()
        for sock in self._sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept or relay; close alone would not
            except OSError:
                pass
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
                if self.closed.is_set():
                    client.close()
                    return
                upstream = socket.create_connection(self._upstream)
            except OSError:
                return
            self._sockets += [client, upstream]
            threading.Thread(target=self._relay, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._relay, args=(upstream, client, False), daemon=True).start()

    def _relay(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if not self.stalled.is_set():
                    dst.sendall(data)
                elif from_client and data.startswith(b"PUT "):
                    self.swallowed_puts += 1
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture
def endpoint(s3_endpoint: str) -> Iterator[StallingEndpoint]:
    proxy = StallingEndpoint(s3_endpoint)
    yield proxy
    proxy.close()


def hanging_options(endpoint: StallingEndpoint) -> dict[str, Any]:
    """s3fs options through the proxy: a request waits an hour for its answer."""
    options = s3_options(endpoint.url)
    options["config_kwargs"] = {"connect_timeout": 2, "read_timeout": 3600, "retries": {"max_attempts": 1}}
    return options


#: The process under test: puts a chain and flushes it (the remote answers),
#: then, told to, puts its continuation (its upload hangs) and, told to,
#: closes the store and returns from its main.
CHILD = textwrap.dedent("""
    import json, logging, sys
    import ucm_db
    sys.path.insert(0, sys.argv[2])
    from node_proc import chain
    logging.basicConfig(level=logging.WARNING)
    spec = json.loads(sys.argv[1])
    namespace = ucm_db.Namespace.from_dict(spec["namespace"])
    keys, payloads = chain(namespace, 4)
    store = ucm_db.open(spec["store"], capacity_bytes=spec["cap"], remote=spec["remote"],
                        remote_options=spec["options"], remote_mode="write_back", upload_concurrency=2)
    store.put(namespace, keys[:2], payloads[:2])
    store.flush(upload_timeout_s=30)
    print("FLUSHED", flush=True)
    sys.stdin.readline()
    store.put(namespace, keys[2:], payloads[2:], parent=keys[1])
    print("PUT", flush=True)
    sys.stdin.readline()
    store.close()
    print("CLOSED", flush=True)
""")


def test_a_process_closing_its_store_exits_while_an_upload_hangs(
    endpoint: StallingEndpoint, s3_endpoint: str, tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    """The process closes its store while an upload hangs and returns from
    its main: it exits (it used to hang at exit for good), its close logs
    the upload it abandoned, and the blocks it could not upload stay queued:
    the store opened again (the remote answering) uploads them."""
    import json

    url = f"s3://{BUCKET}/closing-{tmp_path.name}"
    spec = {"store": str(tmp_path / "a"), "cap": CAP, "remote": url, "options": hanging_options(endpoint),
            "namespace": namespace.to_dict()}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(spec), str(Path(__file__).parent)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "FLUSHED"
        endpoint.stall()  # the endpoint stops answering
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "PUT"
        assert endpoint.wait_for_swallowed_put(30), "the continuation's upload never started"
        proc.stdin.write("\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the process did not exit after closing its store (stdout {out!r}); stderr tail: {err[-1500:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "CLOSED" in out
    assert "abandoned" in err and "block uploads" in err, err[-3000:]
    keys, payloads = chain(namespace, 4)
    options = s3_options(s3_endpoint)
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=url, remote_options=options) as again:
        again.flush(upload_timeout_s=60)  # the next uploader drains what the hung one left queued
    with ucm_db.open(tmp_path / "reader", capacity_bytes=CAP, remote=url, remote_options=options,
                     remote_deadline_s=10) as reader:
        assert reader.get(namespace, keys) == payloads


def test_close_ends_a_write_through_put_waiting_on_a_hung_remote(
    endpoint: StallingEndpoint, tmp_path: Path, namespace: ucm_db.Namespace,
) -> None:
    """A write-through put whose upload hangs is an operation in flight,
    which close waits for (up to three minutes, then it releases anyway):
    close now ends the put's wait at once (TierError: the blocks stay
    stored and queued), and returns."""
    keys, payloads = chain(namespace, 3)
    url = f"s3://{BUCKET}/through-{tmp_path.name}"
    store = ucm_db.open(tmp_path / "a", capacity_bytes=CAP, remote=url, remote_options=hanging_options(endpoint),
                        remote_mode="write_through", remote_deadline_s=5)
    store.put(namespace, keys[:1], payloads[:1])  # the remote answers
    endpoint.stall()
    outcome: list[BaseException | None] = []

    def put() -> None:
        try:
            store.put(namespace, keys[1:], payloads[1:], parent=keys[0])
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome.append(exc)

    putter = threading.Thread(target=put)
    putter.start()
    assert endpoint.wait_for_swallowed_put(30)
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(60)
    putter.join(60)
    assert not closer.is_alive(), "close waited for the put stuck on the hung remote"
    assert len(outcome) == 1 and isinstance(outcome[0], ucm_db.TierError), outcome
    assert "closing" in str(outcome[0])
    with ucm_db.open(tmp_path / "a", capacity_bytes=CAP) as again:  # stored and queued, not lost
        assert [bytes(b) if b is not None else None for b in again.get(namespace, keys)] == payloads
