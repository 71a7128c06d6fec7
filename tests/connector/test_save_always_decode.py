"""``save: "always"`` skips admission's sighting count (``admit_after``), not
the deployment's ``save_decode``: with ``save_decode: false`` the blocks
holding generated tokens are still not stored (docs/connector.md, the
``save`` row; audit of 2026-12, operator controls, doc item a: the doc said
"every computed block"). The scheduler, a worker and a real store, driven as
vLLM drives them (test_request_controls.py's Engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from ucm_db.connector.settings import ConnectorSettings  # noqa: E402

from test_request_controls import BS, UNITS_PER_BLOCK, Engine, _request  # noqa: E402


def test_save_always_stores_the_prompt_at_first_sighting_and_no_decode_block(tmp_path: Path) -> None:
    eng = Engine(ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "admit_after": 2, "save_decode": False}))
    try:
        req = _request(list(range(1, 2 * BS + 6)), {"save": "always"}, max_tokens=2 * BS)
        _, saves = eng.prefill(req)
        assert saves == [(0, 1)]  # both prompt blocks, at the first sighting (admit_after 2 would refuse them)
        decode_saves = [save for token in range(2 * BS) for save in eng.decode(req, 7 + token % 50)]
        assert req.num_computed_tokens // BS >= 4  # blocks 2 and 3 were completed in decode
        assert decode_saves == [] and eng.stored_units() == 2 * UNITS_PER_BLOCK
    finally:
        eng.close()
