"""Stand-in engines for the PD / MultiConnector audit tests (test_audit_pd_*.py).

:class:`PdEngine` is stand_in_engine.py's engine (vLLM's real ``Scheduler``
or ``AsyncScheduler``, the stand-in model runner whose KV depends on every
KV it reads) with any ``kv_transfer_config``: one ucm-db connector of a
given ``kv_role``, or vLLM's real ``MultiConnector`` over several ucm-db
children, each on its own store and role. vLLM's scheduler makes its
connector from the config as in an engine; the runner makes the worker half
the same way (``KVConnectorFactory``), so every hook goes through vLLM's
own MultiConnector code.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from stand_in_engine import BS, HEAD, HEADS, LAYER, LAYERS, StandInEngine, StandInRunner, kv_cache_config, vllm_config  # noqa: E402

from ucm_db.connector.connector import UcmDbConnector  # noqa: E402


def child(store: Path, role: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ucm-db child of a MultiConnector, as ``--kv-transfer-config`` gives it."""
    return {"kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector", "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"path": str(store), "codec": "none", "save_process": False, **(extra or {})}}


def multi_transfer(children: list[dict[str, Any]], role: str) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="MultiConnector", kv_role=role, kv_load_failure_policy="recompute",
                            kv_connector_extra_config={"connectors": children})


class _Runner(StandInRunner):
    """The stand-in runner with the worker half vLLM's factory makes for the config."""

    def __init__(self, config: Any, num_blocks: int) -> None:
        self.kv = {LAYER.format(i): torch.zeros(num_blocks, HEADS, BS, 2 * HEAD, dtype=torch.float32) for i in range(LAYERS)}
        self.connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config(num_blocks))
        self.connector.register_kv_caches(self.kv)
        self.reqs = {}
        self.step = 0
        self.before_load = None
        self.invalid_seen = set()


class PdEngine(StandInEngine):
    """A stand-in engine whose connector is what ``transfer`` configures."""

    def __init__(self, root: Path, transfer: KVTransferConfig, *, overlapped: bool = False, num_blocks: int = 256) -> None:
        init_none_hash(sha256)
        self.config = vllm_config(root, root / "unused-store", async_scheduling=overlapped)
        self.config.kv_transfer_config = transfer
        self.config.cache_config.num_gpu_blocks = num_blocks
        scheduler_cls = AsyncScheduler if overlapped else Scheduler
        self.sched = scheduler_cls(self.config, kv_cache_config(num_blocks), StructuredOutputManager(self.config), BS)
        self.runner = _Runner(self.config, num_blocks)
        self.overlapped = overlapped
        self.hasher = get_request_block_hasher(BS, sha256)
        self.outputs = {}
        self.kv_params = {}
        self.post_execute = []
        self.scheduled = []
        self._in_flight = None

    def children(self, side: str = "scheduler") -> list[UcmDbConnector]:
        """ucm-db's connectors of the scheduler (or the worker) side, in child order."""
        connector = self.sched.connector if side == "scheduler" else self.runner.connector
        return list(connector.sub_connectors) if isinstance(connector, MultiConnector) else [connector]  # type: ignore[list-item]

    @property
    def ours(self) -> Any:
        return self.children()[0]._scheduler

    def run_until_done(self, max_s: float = 60.0) -> float:
        """Steps until every request finished (a step that scheduled nothing
        sleeps 5 ms, as an engine would spin); returns the seconds it took.
        Raises AssertionError after ``max_s`` (a request wedged)."""
        started = time.monotonic()
        while self.sched.has_requests() or self._in_flight is not None:
            assert time.monotonic() - started < max_s, f"requests still unfinished after {max_s} s"
            if not self.sched.has_requests():
                self._update(*self._in_flight)
                self._in_flight = None
                continue
            self.step()
            if not self.scheduled[-1].total_num_scheduled_tokens:
                time.sleep(0.005)
        return time.monotonic() - started

    def close(self) -> None:
        for worker in self.children("worker"):
            worker._worker.drain()  # type: ignore[union-attr]
        self.runner.connector.shutdown()
        self.sched.connector.shutdown()  # type: ignore[union-attr]
