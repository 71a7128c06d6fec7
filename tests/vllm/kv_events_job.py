"""vLLM KV events subscriber, in an ``engine_job.py`` process or a test's.

A SUB socket on vLLM's ZMQ publisher, connected before the engine starts
(ZMQ reconnects until the publisher binds), collects every batch on a
thread; :meth:`EventSubscriber.replay_missing` fills what it missed from
vLLM's replay endpoint, :meth:`EventSubscriber.events` decodes them in
publishing order. For ``engine_job.py``, :meth:`EventSubscriber.collect` waits for the connector's saves to
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


def events_config(pub_port: int, replay_port: int) -> dict[str, Any]:
    """vLLM's ``kv_events_config``: its ZMQ publisher and replay endpoint on these ports."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub_port}",
            "replay_endpoint": f"tcp://*:{replay_port}", "topic": ""}


class EventSubscriber:
    """A SUB socket on vLLM's publisher (``pub_port``), read on a thread."""

    def __init__(self, pub_port: int) -> None:
        import zmq

        self._ctx: Any = zmq.Context.instance()
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

    def replay_missing(self, replay_port: int) -> int:
        """Asks vLLM's replay endpoint for every batch from seq 0 and keeps
        those the SUB socket missed (a slow joiner); returns how many."""
        import zmq

        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        missed = 0
        while True:
            assert dealer.poll(30_000), "no reply from vLLM's replay endpoint"
            _, _topic, seq_bytes, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq < 0:
                break
            if seq not in self._batches:
                self._batches[seq] = payload
                missed += 1
        dealer.close(linger=0)
        return missed

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sub.close(linger=0)

    def events(self) -> list[Any]:
        """vLLM's events of every batch received, in publishing order (no gap allowed)."""
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        assert sorted(self._batches) == list(range(len(self._batches))), "a gap in the publisher's sequence"
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        return [event for seq in sorted(self._batches) for event in decoder.decode(self._batches[seq]).events]

    def collect(self, drive: Callable[[list[int]], object], events: dict[str, Any]) -> list[dict[str, Any]]:
        """``drive(ids)`` runs one request of token ``ids`` on the engine."""
        from e2e_helpers import StoreCounter, wait_for_new_blocks

        with StoreCounter() as count_blocks:  # the engine may hold the store open in this process
            wait_for_new_blocks(Path(events["settle_store"]), 0, count_blocks=count_blocks)
        # Held saves commit at the next step, their events are published a step later: three requests.
        for ids in ([5, 6, 7], [5, 6, 8], [5, 6, 9]):
            drive(ids)
            time.sleep(0.5)
        self.replay_missing(events["replay_port"])
        self.close()
        out = []
        for event in self.events():
            hashes = [h if isinstance(h, int) else bytes(h).hex() for h in getattr(event, "block_hashes", None) or []]
            out.append({"type": type(event).__name__, "medium": getattr(event, "medium", None),
                        "group_idx": getattr(event, "group_idx", None), "block_hashes": hashes})
        return out
