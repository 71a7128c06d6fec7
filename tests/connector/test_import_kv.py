"""``import_kv`` (connector/warming.py) keys imported blocks at the
namespace's current epoch, as the connector's lookups do: after ``ucm-db
invalidate`` (or another engine's reset) the imported KV is served, and
loads back byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from ucm_db.connector.identity import namespace  # noqa: E402
from ucm_db.connector.layouts import detect_layout  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.warming import import_kv  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402

from test_scheduler_worker import BS, NUM_BLOCKS, _admit, _kv, _new_step, _request, _shape  # noqa: E402

TOKENS = list(range(1, 4 * BS + 1))  # 4 blocks: 3 claimable


def test_kv_imported_after_an_invalidation_is_served_at_the_current_epoch(tmp_path: Path) -> None:
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store")})
    sched = UcmDbScheduler(settings, _shape())
    worker = UcmDbWorker(settings, _shape(), NUM_BLOCKS)
    fresh = _kv()
    worker.register_kv_caches(fresh, 0, 0)
    try:
        store, ns = sched.store, namespace(_shape())
        assert store.bump_epoch(ns) == 1  # what `ucm-db invalidate` does
        source = {name: torch.randn(t.shape).to(torch.bfloat16) for name, t in _kv().items()}
        result = import_kv(store, ns, detect_layout(source, NUM_BLOCKS), TOKENS, [9, 3, 7, 5])
        assert result.stored == 4 * 2  # one unit per KV head of each block
        sched.build_connector_meta(_new_step(_request("x", TOKENS), [0], 1))  # the scheduler reads the epoch each step
        req = _request("r", TOKENS)
        assert _admit(sched, req) == 3 * BS  # keyed at epoch 0 they were never found
        meta = sched.build_connector_meta(_new_step(req, [20, 21, 22, 23], BS))
        (load,) = meta.loads
        assert meta.epoch == 1 and load.keys == tuple(ns.block_keys(TOKENS, epoch=1)[:3])
        worker.start_load(meta)
        assert worker.take_load_errors() == set()
        for name in source:
            for src, dst in ((9, 20), (3, 21), (7, 22)):
                assert torch.equal(fresh[name][dst].view(torch.int16), source[name][src].view(torch.int16))
    finally:
        worker.shutdown()
        sched.shutdown()
