"""A hybrid model under MultiConnector: after ucm-db's own async load of a
request failed, GroupedScheduler answered the retry's lookup with 0 without any
part starting a lookup, so the parts kept the failed lookup's async claim and
the ucm-db load note; another kind of connector then loaded 3 blocks into the
request and ucm-db saved them (store_foreign_loads is false). Now the retry is a
lookup of every part: the request saves nothing, as a fresh request loaded the
same way (connector/composition.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from test_hybrid import (BS, TOKENS, GroupedScheduler, _Engine, _request, _step, admit, blocks_of,  # noqa: E402,F401
                         model_dir, restarted_on_a_filled_store)
from ucm_db.connector import composition  # noqa: E402


def _foreign_load_then_step(engine: _Engine, req: Any, ids: Any) -> list[list[tuple[int, ...]]]:
    engine.scheduler.update_state_after_alloc(req, blocks_of(ids), 0)  # the foreign child was chosen, ucm-db got 0
    req.num_computed_tokens = 3 * BS  # what the foreign child loaded
    meta = engine.scheduler.build_connector_meta(_step(req, ids, len(TOKENS) - 3 * BS))
    return [[t.block_ids for t in g.saves] for g in meta.groups]


def test_foreign_load_after_failed_async_is_saved(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    second, sched, lose_window_unit = restarted_on_a_filled_store(model_dir, tmp_path)

    def lose(meta: Any) -> None:
        lose_window_unit(meta.groups[0].async_loads[0].keys[1])

    req = _request("b", TOKENS)
    assert admit(second.scheduler, second.worker, req, ([0, 0, 23, 24, 25, 26], list(range(31, 37))),
                 expect_failed=True, before_load=lose) == 6 * BS
    assert second.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)  # retry: ucm-db claims nothing
    assert [p._requests["b"].async_claimed for p in sched._attention] == [False, False]
    assert "b" not in composition._ucm_db_loads
    ids = (list(range(1, 8)), list(range(11, 18)))
    after_failed = _foreign_load_then_step(second, req, ids)

    fresh = _request("c", [900 - (i % 300) for i in range(len(TOKENS))])  # misses in ucm-db: the foreign child loads it
    assert second.scheduler.get_num_new_matched_tokens(fresh, 0)[0] == 0
    fresh_saves = _foreign_load_then_step(second, fresh, (list(range(1, 8)), list(range(11, 18))))
    second.close()
    assert fresh_saves == [[], []]
    assert after_failed == [[], []], "foreign-loaded KV saved after ucm-db's failed async load"
