"""Under vLLM's MultiConnector, KV another kind of connector loaded into a
request (a PD transfer connector that checks the model's path, not its files;
a cache keyed by model name) is not known to be this engine's KV: ucm-db used
to store it, and every block computed over it, under this engine's
content-keyed namespace, where every engine with these weights would load it.
Now such a request saves nothing unless ``store_foreign_loads`` is set; what
another ucm-db child of the engine loaded is saved as before
(connector/composition.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.connector.test_scheduler_worker import BS, _new_step, _request, _shape  # noqa: E402
from ucm_db.connector import composition  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402

TOKENS = list(range(1, 4 * BS + 1))


@pytest.fixture(autouse=True)
def no_noted_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process-wide note of ucm-db's loads, empty per test (request ids repeat across tests)."""
    from collections import OrderedDict

    monkeypatch.setattr(composition, "_ucm_db_loads", OrderedDict())


def _saved_after_sibling_load(tmp_path: Path, req_id: str, *, noted_by_ucm_db: bool = False, **extra: object) -> int:
    """Blocks the step saves for a request whose first 3 blocks another child
    of a MultiConnector loaded (this ucm-db child found nothing: a new store)."""
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / req_id), **extra})
    sched = UcmDbScheduler(settings, _shape())
    try:
        req = _request(req_id, list(TOKENS))
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
        if noted_by_ucm_db:
            composition.note_ucm_db_load(req_id)  # what another ucm-db child's update_state_after_alloc does
        req.num_computed_tokens = 3 * BS  # the sibling's hit
        meta = sched.build_connector_meta(_new_step(req, [7, 8, 9, 10], len(TOKENS) - 3 * BS))
        return sum(len(save.keys) for save in meta.saves)
    finally:
        sched.shutdown()


def test_a_request_another_kind_of_connector_loaded_saves_nothing(tmp_path: Path) -> None:
    assert _saved_after_sibling_load(tmp_path, "foreign") == 0


def test_a_request_another_ucm_db_child_loaded_is_saved(tmp_path: Path) -> None:
    assert _saved_after_sibling_load(tmp_path, "ucm-db-sibling", noted_by_ucm_db=True) == 4


def test_store_foreign_loads_saves_what_another_connector_loaded(tmp_path: Path) -> None:
    assert _saved_after_sibling_load(tmp_path, "trusted", store_foreign_loads=True) == 4


def test_a_ucm_db_load_is_noted_when_vllm_allocates_it(tmp_path: Path) -> None:
    """The loading child notes its load in update_state_after_alloc, before
    any child builds its step (a sibling built first would not see it later)."""
    from ucm_db.connector.identity import grid, namespace, reader_spans
    from ucm_db.keys.units import UnitKeys

    sched = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "s")}), _shape())
    try:
        keys = namespace(_shape()).block_keys(TOKENS)
        for span in reader_spans(_shape()):
            sched.store.put(namespace(_shape()), list(UnitKeys(keys, grid(_shape()), span)), [b"kv"] * len(keys), parent=None)
        req = _request("loaded-here", list(TOKENS))
        hit, _ = sched.get_num_new_matched_tokens(req, 0)
        assert hit and "loaded-here" not in composition._ucm_db_loads
        sched.update_state_after_alloc(req, None, hit)  # type: ignore[arg-type]
        assert "loaded-here" in composition._ucm_db_loads
    finally:
        sched.shutdown()


def test_store_foreign_loads_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="store_foreign_loads"):
        ConnectorSettings.from_extra_config({"path": str(tmp_path / "s"), "store_foreign_loads": "yes"})
