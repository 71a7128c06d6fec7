"""The scheduler's namespace travels in every step's metadata
(connector/worker/hooks.py ``_agree``): a worker that derived another one
from the same deployment's config takes the scheduler's where only inputs
read from the config object differ (a model constructor changed the
worker's copy, or the worker's node lacks the config's files); where
anything else differs (the model's files, the layout: other KV) it loads
and saves nothing from then on and the scheduler stops claiming and
saving. Real scheduler and worker halves, a real store, CPU KV tensors."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.connector.test_request_controls import BS, NUM_BLOCKS, SHAPE, Engine, _kv, _prefill_step, _request  # noqa: E402
from ucm_db.connector.identity import namespace  # noqa: E402
from ucm_db.connector.metadata import UcmDbWorkerMetadata  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402

TOKENS = list(range(1, 4 * BS + 10))
LOG = "vllm.ucm_db.connector.worker.hooks"


def _stored(tmp_path: Path, shape: object = SHAPE) -> tuple[ConnectorSettings, int]:
    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "load_policy": "always"})
    same = Engine(settings)
    assert same.prefill(_request(TOKENS))[0] == 0  # stored under the scheduler's namespace
    stored = same.stored_units()
    same.close()
    return settings, stored


def _step(scheduler: UcmDbScheduler, worker: UcmDbWorker) -> tuple[int, object]:
    """A request of TOKENS and one more block: lookup, allocation, its step's loads and saves."""
    req = _request(TOKENS + [3] * BS)
    hit, _ = scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, None, hit)  # type: ignore[arg-type]
    req.num_computed_tokens = hit
    meta = scheduler.build_connector_meta(_prefill_step(req, list(range(req.num_tokens // BS + 1)), req.num_tokens - hit))
    worker.start_load(meta)
    worker.finish_loads()
    worker.save(meta)
    worker.drain()
    scheduler.observe_output(worker.take_worker_meta())
    return hit, meta


def test_a_worker_whose_config_object_differs_takes_the_schedulers_namespace(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings, stored = _stored(tmp_path)
    scheduler = UcmDbScheduler(settings, SHAPE)
    changed = dataclasses.replace(SHAPE, extra='{"rope":{"rope_theta":1000000.0}}')  # e.g. set_default_rope_theta
    worker = UcmDbWorker(settings, changed, NUM_BLOCKS)
    worker.register_kv_caches(_kv(), 0, 0)
    try:
        with caplog.at_level(logging.WARNING, logger=LOG):
            hit, meta = _step(scheduler, worker)
        assert hit == 4 * BS and meta.namespace == namespace(SHAPE).id and "the scheduler's are used" in caplog.text
        assert worker.take_load_errors() == set() and not worker.refused
        assert scheduler.store.stats().blocks == stored + 2  # the new block, under the scheduler's namespace
        assert list(scheduler.store.stats().namespaces) == [namespace(SHAPE).id.hex()]
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_a_worker_of_another_model_refuses_and_the_scheduler_stops(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings, stored = _stored(tmp_path)
    scheduler = UcmDbScheduler(settings, SHAPE)
    worker = UcmDbWorker(settings, dataclasses.replace(SHAPE, model="other-weights"), NUM_BLOCKS)
    worker.register_kv_caches(_kv(), 0, 0)
    try:
        with caplog.at_level(logging.ERROR, logger=LOG):
            hit, meta = _step(scheduler, worker)
        assert hit == 4 * BS and meta.loads and meta.saves  # the scheduler's own namespace holds these blocks
        assert caplog.text.count("computes other KV") == 1 and worker.refused
        assert worker.take_load_errors() == set(range(4))  # every claimed block fails: vLLM recomputes it
        assert scheduler.store.stats().blocks == stored  # nothing saved under the scheduler's keys
        hit, meta = _step(scheduler, worker)  # told through the worker metadata: nothing claimed, nothing planned
        assert (hit, meta.loads, meta.saves) == (0, [], [])
        assert caplog.text.count("computes other KV") == 1  # logged once
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_a_producer_whose_worker_refused_publishes_nothing(tmp_path: Path) -> None:
    """Its saves were never written: a consumer must not wait for them."""
    from ucm_db.connector.roles import RolePolicy

    settings, _ = _stored(tmp_path)
    scheduler = UcmDbScheduler(settings, SHAPE, RolePolicy("kv_producer"))
    worker = UcmDbWorker(settings, dataclasses.replace(SHAPE, model="other-weights"), NUM_BLOCKS, RolePolicy("kv_producer"))
    worker.register_kv_caches(_kv(), 0, 0)
    try:
        req = _request(list(range(500, 500 + 4 * BS + 10)))
        scheduler.get_num_new_matched_tokens(req, 0)
        scheduler.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
        meta = scheduler.build_connector_meta(_prefill_step(req, list(range(5)), req.num_tokens))
        assert meta.saves  # planned before the refusal reached the scheduler
        worker.start_load(meta)
        worker.save(meta)
        scheduler.observe_output(worker.take_worker_meta())
        assert scheduler.request_finished(req, list(range(5))) == (False, None)
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_the_refusal_aggregates_over_ranks() -> None:
    quiet, refusing = UcmDbWorkerMetadata(step=3), UcmDbWorkerMetadata(step=3, refused=True)
    assert quiet.aggregate(refusing).refused  # type: ignore[attr-defined]


QUANT = '"quantization_config":{"dynamic":"(?:mlp|self_attn)"}'  # a "|" inside the inputs


@pytest.mark.parametrize(("ours", "theirs", "adopted"), [
    ('{"rope":{"rope_theta":1000000.0}}', "", True),  # set_default_rope_theta in a TP>1 worker's copy
    ('{"hf_config":"json-blake2b:aa"}', '{"hf_config":"blake2b:bb"}', True),  # this node lacks the config's files
    ('{"hf_config":"blake2b:aa"}', '{"hf_config":"blake2b:bb"}', False),  # another config directory on this node
    ('{"long_rope":true}', '{"long_rope":false}', False),  # a headless node with its own --max-model-len
    ('{"mm_encoder_attn":["fp8","blake2b:aa"]}', '{"mm_encoder_attn":["fp8","blake2b:bb"]}', False),  # another scale file
    ('{"dtype":"float16"}', "", False),
    ('{"remote_code":{"o/c@main":"unresolved"}}', '{"remote_code":{"o/c@main":"blake2b:bb"}}', True),  # code not on this node
    ('{"remote_code":{"o/c@main":"blake2b:aa"}}', '{"remote_code":{"o/c@main":"blake2b:bb"}}', False),  # other code here
    ('{"remote_code":{"o/c@main":"unresolved"}}', '{"remote_code":{"o/c@v2":"blake2b:bb"}}', False),  # another revision
    ("{" + QUANT + ',"rope":{"rope_theta":1000000.0}}', "{" + QUANT + "}", True),
    # An hf_overrides function: the config it left, changed by the worker's model; another function is other KV.
    ('{"hf_overrides":{"config":"aa","function":"m.f"}}', '{"hf_overrides":{"config":"bb","function":"m.f"}}', True),
    ('{"hf_overrides":{"config":"aa","function":"m.f"}}', '{"hf_overrides":{"config":"bb","function":"m.g"}}', False),
    ('{"hf_overrides":{"attention_bias":true}}', '{"hf_overrides":{"attention_bias":false}}', False),  # a node's own dict
])
@pytest.mark.parametrize("group", [None, '{"group":"sliding_window","layers":["l0"],"window":128}'])
def test_only_constructor_changed_inputs_are_taken_from_the_scheduler(ours: str, theirs: str, adopted: bool,
                                                                      group: str | None) -> None:
    from ucm_db.connector.identity import schedulers_namespace

    def full(inputs: str) -> str:  # a hybrid group's namespace extra (hybrid/groups.py)
        return inputs if group is None else (inputs + "|" if inputs else "") + group

    mine = dataclasses.replace(namespace(SHAPE), extra=full(ours))
    scheduler = dataclasses.replace(namespace(SHAPE), extra=full(theirs))
    taken = schedulers_namespace(mine, ours, scheduler.id, theirs)
    assert (taken == scheduler) if adopted else taken is None
    assert schedulers_namespace(mine, ours, b"\0" * 16, theirs) is None  # an id the inputs do not give: never
