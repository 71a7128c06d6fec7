"""A server with an unusable store fails fast, as users run it (issue 11,
item 6): ``python -m vllm.entrypoints.openai.api_server`` with the
connector's store path naming a file. The server must exit on its own, the
one ``ucm-db connector cannot start`` line (error and hint) must come before
vLLM profiles memory, allocates the KV cache or warms up / compiles, and it
must take well under the time a healthy start of the same server takes
(45-135 s on the 2-core development machine, of which the weights are a
small part).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from pd_helpers import ServerProcess, build_text_model, vllm_server_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

#: What vLLM logs once it is past loading the weights, in start-up order.
LATER_STAGES = ("KV cache layout", "KV cache size", "Available KV cache memory", "init engine (profile, create kv cache, warmup",
                "Warming up", "Capturing", "Starting vLLM server")


def test_an_unusable_store_stops_the_server_before_warm_up(tmp_path: Path) -> None:
    model = build_text_model(tmp_path / "model")
    (tmp_path / "store").write_text("a file where the store directory should be")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    started = time.monotonic()
    server = ServerProcess.start(vllm_server_args(model, port, "kv_both", {"path": str(tmp_path / "store")}), port,
                                 tmp_path / "server.log", {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
    try:
        rc = server.proc.wait(600)
    finally:
        server.kill()
    seconds = time.monotonic() - started
    log = server.log()
    print(f"unusable store: server exited rc={rc} after {seconds:.1f} s, {len(log.splitlines())} log lines")
    assert rc != 0
    marker = "ucm-db connector cannot start: "
    assert marker in log, log[-3000:]
    line = next(line for line in log.splitlines() if marker in line)
    assert "is a file, not a directory (hint: move " in line
    before = log[: log.index(marker)]
    assert not [stage for stage in LATER_STAGES if stage in before], before[-3000:]
