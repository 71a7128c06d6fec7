"""Prefill/decode roles (issue 11) with real vLLM request objects, a real
LMDB store and CPU KV tensors, without an engine.

A producer's scheduler and worker halves run one step and finish the
request; a consumer's halves (a second scheduler/worker pair on the same
store, standing for the decode engine) get the producer's
``kv_transfer_params``.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, KVConnectorBlockState, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from ucm_db.connector.identity import KVShape, namespace  # noqa: E402
from ucm_db.connector.metadata import BlockTransfer, UcmDbConnectorMetadata  # noqa: E402
from ucm_db.connector.roles import PARAMS_KEY, Publication, PublicationWaits, RolePolicy, producer_store_options  # noqa: E402
from ucm_db.connector.scheduler.hooks import UcmDbScheduler  # noqa: E402
from ucm_db.connector.settings import ConnectorSettings  # noqa: E402
from ucm_db.connector.worker.hooks import UcmDbWorker  # noqa: E402
from ucm_db.errors import ConfigError  # noqa: E402

BS = 32
NUM_BLOCKS = 32
PRODUCER, CONSUMER = RolePolicy("kv_producer"), RolePolicy("kv_consumer")
SHAPE = KVShape(model="tiny", kv_dtype="bfloat16", block_size=BS, use_mla=False, layout="cpu-test", tp_size=1, pp_size=1,
                kv_heads=2, layers=2)


def _request(req_id: str, tokens: list[int], params: dict[str, Any] | None = None) -> Request:
    extra = {"kv_transfer_params": params} if params is not None else None
    return Request(req_id, tokens, SamplingParams(max_tokens=1, extra_args=extra), None)  # type: ignore[arg-type]


def _kv(seed: int | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = (NUM_BLOCKS, 2, BS, 128)
    return {f"layers.{i}.attn": (torch.randn(shape, generator=gen) if gen else torch.zeros(shape)).to(torch.bfloat16) for i in range(2)}


def _step(req: Request, block_ids: list[int], num_tokens: int) -> SchedulerOutput:
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData.from_request(req, (block_ids,))], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={req.request_id: num_tokens}, total_num_scheduled_tokens=num_tokens,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
    )
    out.kv_connector_block_state = KVConnectorBlockState({req.request_id}, lambda _rid: (block_ids,), {})
    return out


@pytest.fixture()
def settings(tmp_path: Path) -> ConnectorSettings:
    return ConnectorSettings.from_extra_config({"path": str(tmp_path / "store"), "load_deadline_s": 0.3})


def _produce(settings: ConnectorSettings, tokens: list[int], kv: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One prefill step of a producer; returns its kv_transfer_params. The
    worker is NOT drained: the commit must have happened inside save()."""
    sched, worker = UcmDbScheduler(settings, SHAPE, PRODUCER), UcmDbWorker(settings, SHAPE, NUM_BLOCKS, PRODUCER)
    worker.register_kv_caches(kv, 0, 0)
    try:
        req = _request("p", tokens)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
        block_ids = list(range(len(tokens) // BS + 1))
        meta = sched.build_connector_meta(_step(req, block_ids, len(tokens)))
        worker.save(meta)
        # Read-after-write: visible to another reader before the step ends.
        consumer_view = UcmDbScheduler(settings, SHAPE, CONSUMER)
        probe = _request("probe", tokens)
        assert consumer_view.get_num_new_matched_tokens(probe, 0)[0] == (len(tokens) - 1) // BS * BS
        consumer_view.shutdown()
        assert worker.counters.totals.data["publish_wait_s"] > 0
        finished, params = sched.request_finished(req, block_ids)
        assert finished is False and params is not None
        return params
    finally:
        worker.shutdown()
        sched.shutdown()


def test_producer_commits_within_the_step_and_announces_its_blocks(settings: ConnectorSettings) -> None:
    tokens = list(range(3, 3 + 5 * BS + 7))
    params = _produce(settings, tokens, _kv(0))
    pub = Publication.from_params(params)
    assert pub is not None and pub.blocks == 5 and pub.tokens == 5 * BS and pub.block_size == BS
    assert pub.namespace_id == namespace(SHAPE).digest[:16].hex()
    assert params[PARAMS_KEY]["published_to"] == "local"


@pytest.mark.parametrize(("publish_codec", "compressed"), [(None, False), ("none", False), ("zstd", True), ("store", True)])
def test_a_producer_publishes_uncompressed_unless_told(tmp_path: Path, publish_codec: str | None, compressed: bool) -> None:
    extra: dict[str, Any] = {"path": str(tmp_path / "store"), "codec": "zstd"}
    if publish_codec is not None:
        extra["publish_codec"] = publish_codec
    settings = ConnectorSettings.from_extra_config(extra)
    params = _produce(settings, list(range(3, 3 + 4 * BS + 1)), _kv(6))
    assert params[PARAMS_KEY]["blocks"] == 4
    sched = UcmDbScheduler(settings, SHAPE, CONSUMER)
    stats = sched.store.stats()
    assert stats.blocks == 4 * SHAPE.kv_heads  # one unit per KV head, all in the step's one commit
    assert (stats.stored_bytes < stats.raw_bytes) is compressed
    sched.shutdown()


def test_an_unknown_publish_codec_is_refused_with_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="publish_codec must be one of none, zstd, store"):
        ConnectorSettings.from_extra_config({"path": str(tmp_path), "publish_codec": "lz4"})


def test_consumer_claims_published_blocks_and_loads_them(settings: ConnectorSettings) -> None:
    tokens = list(range(3, 3 + 4 * BS))  # an exact multiple of the block size
    kv = _kv(1)
    params = _produce(settings, tokens, kv)
    assert params[PARAMS_KEY]["blocks"] == 4  # the producer computed the last block too
    sched, worker = UcmDbScheduler(settings, SHAPE, CONSUMER), UcmDbWorker(settings, SHAPE, NUM_BLOCKS, CONSUMER)
    fresh = _kv()
    worker.register_kv_caches(fresh, 0, 0)
    blocks_before = sched.store.stats().blocks
    req = _request("c", tokens, params)
    ext, is_async = sched.get_num_new_matched_tokens(req, 0)
    assert (ext, is_async) == (3 * BS, False)  # the block holding the last token is recomputed
    sched.update_state_after_alloc(req, None, ext)  # type: ignore[arg-type]
    req.num_computed_tokens = ext
    meta = sched.build_connector_meta(_step(req, [9, 10, 11, 12], len(tokens) - ext))
    assert meta.saves == [] and meta.loads[0].block_ids == (9, 10, 11)
    worker.start_load(meta)
    assert worker.take_load_errors() == set()
    for name in kv:
        assert torch.equal(fresh[name][9:12].view(torch.int16), kv[name][0:3].view(torch.int16))
    assert sched.request_finished(req, [9, 10, 11, 12]) == (False, None)  # consumers announce nothing
    assert sched.store.stats().blocks == blocks_before
    worker.shutdown()
    sched.shutdown()


def test_consumer_never_saves_even_when_handed_saves(settings: ConnectorSettings) -> None:
    worker = UcmDbWorker(settings, SHAPE, NUM_BLOCKS, CONSUMER)
    worker.register_kv_caches(_kv(2), 0, 0)
    keys = tuple(namespace(SHAPE).block_keys(list(range(3, 3 + 2 * BS))))
    worker.save(UcmDbConnectorMetadata(saves=[BlockTransfer("x", keys, (0, 1))]))
    worker.drain()
    assert worker.counters.totals.data["saved_blocks"] == 0
    worker.shutdown()
    sched = UcmDbScheduler(settings, SHAPE, CONSUMER)
    assert sched.store.stats().blocks == 0
    sched.shutdown()


def test_consumer_waits_for_announced_blocks_then_claims_them(settings: ConnectorSettings, tmp_path: Path) -> None:
    tokens = list(range(7, 7 + 3 * BS + 5))
    # Publish into another store first, to get the params, then wait for the same blocks here.
    other = ConnectorSettings.from_extra_config({"path": str(tmp_path / "elsewhere")})
    kv = _kv(3)
    params = _produce(other, tokens, kv)
    del params[PARAMS_KEY]["stores"]  # it names the store it was published to: as from a producer before store names, waited for
    sched = UcmDbScheduler(settings, SHAPE, CONSUMER)
    req = _request("c", tokens, params)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # not visible: deferred
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # too soon to look again
    _produce(settings, tokens, kv)  # the blocks land
    time.sleep(0.01)
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, False)
    assert sched.counters.totals.data["publication_misses"] == 0
    assert sched.counters.totals.data["publication_wait_s"] > 0
    sched.shutdown()


def test_consumer_recomputes_what_is_missing_at_its_deadline(settings: ConnectorSettings, tmp_path: Path) -> None:
    tokens = list(range(9, 9 + 3 * BS + 5))
    params = _produce(ConnectorSettings.from_extra_config({"path": str(tmp_path / "elsewhere")}), tokens, _kv(4))
    del params[PARAMS_KEY]["stores"]  # it names the store it was published to: as from a producer before store names, waited for
    sched = UcmDbScheduler(settings, SHAPE, CONSUMER)
    req = _request("c", tokens, params)
    deadline = time.monotonic() + 5
    answers = []
    while time.monotonic() < deadline:
        answers.append(sched.get_num_new_matched_tokens(req, 0))
        if answers[-1][0] is not None:
            break
        time.sleep(0.02)
    assert answers[0] == (None, False) and answers[-1] == (0, False)
    assert sched.counters.totals.data["publication_misses"] == 3
    sched.shutdown()


def test_foreign_or_malformed_params_are_an_ordinary_lookup(settings: ConnectorSettings) -> None:
    tokens = list(range(3, 3 + 3 * BS + 1))
    params = _produce(settings, tokens, _kv(5))
    sched = UcmDbScheduler(settings, SHAPE, CONSUMER)
    other_tokens = list(range(500, 500 + 3 * BS + 1))
    bad = [
        {PARAMS_KEY: {**params[PARAMS_KEY], "namespace": "00" * 16}},
        {PARAMS_KEY: {**params[PARAMS_KEY], "blocks": "3"}},
        {PARAMS_KEY: {**params[PARAMS_KEY], "version": 99}},
        {"something": "else"}, "not a dict",
    ]
    for i, p in enumerate(bad):
        assert sched.get_num_new_matched_tokens(_request(f"b{i}", tokens, p), 0) == (3 * BS, False)  # type: ignore[arg-type]
    # Params for other tokens: their last key is not ours, so no wait and no claim.
    assert sched.get_num_new_matched_tokens(_request("o", other_tokens, params), 0) == (0, False)
    sched.shutdown()


def test_publication_waits_follow_the_clock() -> None:
    now = [0.0]
    waits = PublicationWaits(1.0, clock=lambda: now[0])
    assert waits.decide("r", 4, 4) is False
    assert waits.decide("r", 4, 1) is True
    now[0] = 0.002
    assert waits.too_soon("r")
    now[0] = 0.9
    assert not waits.too_soon("r") and waits.decide("r", 4, 1) is True
    now[0] = 1.0
    assert waits.decide("r", 4, 1) is False and waits.waited_s("r") == pytest.approx(1.0)


def test_a_publication_of_other_keys_is_logged_once_and_other_mismatches_not(caplog: pytest.LogCaptureFixture) -> None:
    """Same namespace, a prompt as long, another last key (a reset since, or
    per-process multimodal numbers): logged once; another namespace or a
    shorter prompt is no key mismatch and is not logged."""
    mine = [bytes([i]) * 32 for i in range(4)]
    keys = lambda n: mine[:n]  # noqa: E731 - the consumer's first n keys
    ours = Publication("ns", 4, 16, mine[3].hex(), "local")
    other = dataclasses.replace(ours, last_key="ff" * 32)
    waits = PublicationWaits(1.0)
    with caplog.at_level("WARNING", logger="vllm.ucm_db.connector.roles"):
        assert waits.expected(ours, "ns", 16, keys, 4) == 4
        assert waits.expected(dataclasses.replace(ours, namespace_id="other"), "ns", 16, keys, 4) == 0
        assert waits.expected(other, "ns", 16, lambda n: mine[:2], 4) == 0  # a shorter prompt
        assert "published other keys" not in caplog.text
        assert waits.expected(other, "ns", 16, keys, 4) == waits.expected(other, "ns", 16, keys, 4) == 0
    assert caplog.text.count("published other keys") == 1


def test_role_and_publish_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        RolePolicy("kv_prefill")
    assert "kv_both" in err.value.hint
    with pytest.raises(ConfigError) as err:
        ConnectorSettings.from_extra_config({"path": str(tmp_path), "publish": "nfs"})
    assert "remote" in err.value.hint
    with pytest.raises(ConfigError):
        ConnectorSettings.from_extra_config({"path": str(tmp_path), "load_deadline_s": -1})
    with pytest.raises(ConfigError) as err:
        producer_store_options({}, "remote")
    assert "remote" in err.value.hint
    with pytest.raises(ConfigError):
        producer_store_options({"remote": "file:///x", "remote_mode": "write_back"}, "remote")
    assert producer_store_options({"remote": "file:///x"}, "remote")["remote_mode"] == "write_through"
    assert producer_store_options({"remote": "file:///x"}, "local") == {"remote": "file:///x"}
    assert RolePolicy.from_kv_role(None) == RolePolicy("kv_both")
    assert (PRODUCER.saves, PRODUCER.publishes, CONSUMER.saves, CONSUMER.publishes) == (True, True, False, False)


@pytest.mark.s3
def test_consumer_on_another_node_falls_back_within_its_deadline_when_the_remote_is_down(tmp_path: Path) -> None:
    """Two nodes (two local stores) sharing a real S3 endpoint (moto on
    127.0.0.1). With the endpoint up, a consumer loads the producer's
    published blocks through it; with the endpoint stopped, a consumer
    gives up waiting within load_deadline_s (plus the store's remote
    deadline per lookup) and claims nothing."""
    import fsspec
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing", "anon": False,
               "config_kwargs": {"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 1}}}
    try:
        fsspec.filesystem("s3", **options, skip_instance_cache=True).mkdir("ucm-pd")
        remote = {"remote": "s3://ucm-pd/kv", "remote_options": options}
        producer = ConnectorSettings.from_extra_config({"path": str(tmp_path / "p"), "publish": "remote", **remote})
        producer = dataclasses.replace(producer, store_options=producer_store_options(producer.store_options, "remote"))
        tokens = list(range(5, 5 + 3 * BS + 4))
        params = _produce(producer, tokens, _kv(6))
        assert params[PARAMS_KEY]["published_to"] == "remote"
        up = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "c1"), "load_deadline_s": 10, **remote}), SHAPE, CONSUMER)
        asked = _request("c", tokens, params)
        started = time.monotonic()
        # As vLLM does: None is "ask again next step" (a remote fetch cut by
        # the store's short deadline finishes in the background meanwhile).
        while (answer := up.get_num_new_matched_tokens(asked, 0))[0] is None:
            assert time.monotonic() - started < 10, "the published blocks never arrived through the live remote"
            time.sleep(0.01)
        assert answer == (3 * BS, False)
        up.shutdown()
    finally:
        server.stop()
    down = UcmDbScheduler(ConnectorSettings.from_extra_config({"path": str(tmp_path / "c2"), "load_deadline_s": 1.0, **remote}), SHAPE, CONSUMER)
    req = _request("d", tokens, params)
    started = time.monotonic()
    while (answer := down.get_num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() - started < 30, "the consumer kept waiting past its deadline"
        time.sleep(0.01)
    waited_s = time.monotonic() - started
    assert answer == (0, False) and down.counters.totals.data["publication_misses"] == 3
    assert 1.0 <= waited_s < 15, waited_s
    down.shutdown()


def test_a_load_only_consumer_reports_the_compression_ratio(settings: ConnectorSettings) -> None:
    tokens = list(range(3, 3 + 3 * BS + 2))
    params = _produce(settings, tokens, _kv(7))
    sched = UcmDbScheduler(settings, SHAPE, CONSUMER)
    req = _request("c", tokens, params)
    ext, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, None, ext)  # type: ignore[arg-type]
    ns = sched.store.stats().namespaces[namespace(SHAPE).digest[:16].hex()]
    ratio = sched.counters.totals.data["compression_ratio"]
    assert ratio > 0 and ratio == pytest.approx(ns.raw_bytes / ns.stored_bytes)
    sched.shutdown()


def test_a_head_whose_parent_unit_is_gone_loses_only_its_own_chain(tmp_path: Path) -> None:
    # The writer commits a job's head chains in one transaction; when one
    # head's parent unit was evicted meanwhile, that transaction fails and
    # the chains are put one by one: the other head's units still land.
    from ucm_db.keys.units import KVGrid, UnitKeys

    settings = ConnectorSettings.from_extra_config({"path": str(tmp_path / "store")})
    worker = UcmDbWorker(settings, SHAPE, NUM_BLOCKS, RolePolicy("kv_both"))
    worker.register_kv_caches(_kv(7), 0, 0)
    keys = tuple(namespace(SHAPE).block_keys(list(range(3, 3 + 5 * BS))))
    worker.save(UcmDbConnectorMetadata(saves=[BlockTransfer("r", keys[:3], (0, 1, 2))]))
    worker.drain()
    grid = KVGrid(heads=SHAPE.kv_heads, layers=SHAPE.layers)
    head0, head1 = (UnitKeys(keys, grid, span) for span in grid.head_spans())
    store = worker._store
    assert store is not None and store.delete(namespace(SHAPE), [head0[2]]) == 1
    worker.save(UcmDbConnectorMetadata(saves=[BlockTransfer("r", keys[3:], (3, 4), parent=keys[2])]))
    worker.drain()
    assert store.lookup(namespace(SHAPE), list(head1)) == 5
    assert store.lookup(namespace(SHAPE), list(head0)) == 2
    assert worker.counters.totals.data["save_errors"] == 2
    worker.shutdown()
