"""A ``kv_producer`` publishes every block it computes (docs/pd.md), so its
admission never refuses a block (audit of 2026-12, operator controls
finding 2): ``admit_after: "auto"`` is 1 there, and a fixed ``admit_after``
above 1, which published nothing of a prompt's first sighting (its decode
server recomputed the whole prompt), is refused at start with a ConfigError
naming the fix.

Real parts: vLLM's Scheduler building the connector from a
``KVTransferConfig`` as an engine does, a real store; the model runner is
the stand-in of stand_in_engine.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from ucm_db.connector.roles import PARAMS_KEY, RolePolicy  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402

from stand_in_engine import BS, StandInEngine  # noqa: E402
from test_scheduler_worker import _shape  # noqa: E402

PROMPT = [(i * 11 + 1) % 97 for i in range(3 * BS + 7)]


@pytest.mark.parametrize("admit_after", [2, 255])
def test_a_producer_with_a_fixed_admit_after_above_1_is_refused_at_start(tmp_path: Path, admit_after: int) -> None:
    with pytest.raises(ConfigError) as caught:  # was: started, and published 0 blocks of a prompt's first sighting
        StandInEngine(tmp_path, tmp_path / "store", role="kv_producer", extra={"admit_after": admit_after})
    assert f"admit_after {admit_after} on a kv_producer" in str(caught.value)
    assert "admit_after=1" in caught.value.hint and "kv_both" in caught.value.hint


def test_the_refusal_comes_before_the_store_is_opened(tmp_path: Path) -> None:
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "admit_after": 2})
    with pytest.raises(ConfigError):
        UcmDbScheduler(settings, _shape(), RolePolicy("kv_producer"))
    assert not (tmp_path / "store").exists()  # nothing opened, so nothing left open


@pytest.mark.parametrize("admit_after", [1, "auto"])
def test_a_producer_publishes_every_block_of_a_first_sighting(tmp_path: Path, admit_after: int | str) -> None:
    producer = StandInEngine(tmp_path, tmp_path / "store", role="kv_producer", extra={"admit_after": admit_after})
    try:
        producer.add("p", PROMPT, 1)
        producer.run()
        assert producer.kv_params["p"][PARAMS_KEY]["blocks"] == len(PROMPT) // BS
    finally:
        producer.close()


@pytest.mark.parametrize("role", ["kv_both", "kv_consumer"])
def test_admit_after_2_still_starts_where_nothing_is_published(tmp_path: Path, role: str) -> None:
    engine = StandInEngine(tmp_path, tmp_path / "store", role=role, extra={"admit_after": 2})
    try:
        assert engine.ours._admission.admit_after == 2
    finally:
        engine.close()
