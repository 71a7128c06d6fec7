"""vLLM KV events subscriber inside an ``engine_job.py`` process.

A SUB socket on vLLM's ZMQ publisher, connected before the engine starts
(ZMQ reconnects until the publisher binds), collects every batch on a
thread; :meth:`EventSubscriber.collect` waits for the connector's saves to
commit, drives a few more requests (vLLM publishes a connector's events only
inside a scheduler step; a held save commits a step later), asks the replay endpoint for anything the SUB
socket missed, and returns the events in publishing order as plain dicts.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any


class EventSubscriber:
    def __init__(self, pub_port: int) -> None:
        import zmq

        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(f"tcp://127.0.0.1:{pub_port}")
        self._batches: dict[int, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(100):
                _topic, seq, payload = self._sub.recv_multipart()
                self._batches[int.from_bytes(seq, "big")] = payload

    def collect(self, drive: Callable[[list[int]], object], events: dict[str, Any]) -> list[dict[str, Any]]:
        """``drive(ids)`` runs one request of token ``ids`` on the engine."""
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        from e2e_helpers import StoreCounter, wait_for_new_blocks

        with StoreCounter() as count_blocks:  # the engine may hold the store open in this process
            wait_for_new_blocks(Path(events["settle_store"]), 0, count_blocks=count_blocks)
        # Held saves commit at the next step, their events are published a step later: three requests.
        for ids in ([5, 6, 7], [5, 6, 8], [5, 6, 9]):
            drive(ids)
            time.sleep(0.5)
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{events['replay_port']}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            assert dealer.poll(30_000), "no reply from vLLM's replay endpoint"
            _, _topic, seq_bytes, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq < 0:
                break
            self._batches.setdefault(seq, payload)
        dealer.close(linger=0)
        self._stop.set()
        self._thread.join()
        self._sub.close(linger=0)
        assert sorted(self._batches) == list(range(len(self._batches))), "a gap in the publisher's sequence"
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        out = []
        for seq in sorted(self._batches):
            for event in decoder.decode(self._batches[seq]).events:
                hashes = [h if isinstance(h, int) else bytes(h).hex() for h in getattr(event, "block_hashes", None) or []]
                out.append({"type": type(event).__name__, "medium": getattr(event, "medium", None),
                            "group_idx": getattr(event, "group_idx", None), "block_hashes": hashes})
        return out
