"""Review of 2bbb753 (a): one publication per request under a MultiConnector.

``composition.publish_once`` folded a later ucm-db producer child's
publication into the first one's only where both named the same namespace:
the fold was keyed by namespace. Every producer child still writes its
publication under the one key ``ucm_db``, so two children whose namespaces
differ (``model_id`` set on one child only: a shared store keyed by an
explicit model name, a node-local cache keyed by the weights' digest) both
returned params, and vLLM's MultiConnector stopped the engine on the clash.
Fixed: one publication per request, the first ucm-db child's; a later child
of another namespace returns none.

Real parts: vLLM's Scheduler and MultiConnector, ucm-db's connectors on real
stores; the model runner is the stand-in of stand_in_engine.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from stand_in_engine import BS, VOCAB  # noqa: E402
from test_audit_pd_harness import PdEngine, child, multi_transfer  # noqa: E402

from ucm_db.connector.roles import Publication  # noqa: E402

_RNG = random.Random(41)
PROMPT = [_RNG.randrange(VOCAB) for _ in range(4 * BS + 9)]  # 4 whole blocks


def test_two_producer_children_of_different_namespaces_publish_once(tmp_path: Path) -> None:
    nvme, shared = tmp_path / "nvme", tmp_path / "shared"
    prefill = PdEngine(tmp_path, multi_transfer([child(nvme, "kv_producer"),
                                                 child(shared, "kv_producer", {"model_id": "tiny-llama-shared"})], "kv_producer"))
    namespaces = [c._scheduler.namespace.id.hex() for c in prefill.children()]
    assert namespaces[0] != namespaces[1]  # the layout this test is about
    prefill.add("R", PROMPT, 1)
    try:
        prefill.run_until_done()  # RuntimeError: Key clash in kv_transfer_params from multiple connectors: {'ucm_db'}
        params = prefill.kv_params["R"]
    finally:
        prefill.close()
    published = Publication.from_params(params)
    assert published is not None and published.blocks == 4
    assert published.namespace_id == namespaces[0]  # the first child's, naming its store only
