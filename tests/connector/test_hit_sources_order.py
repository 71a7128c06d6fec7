"""Where ucm-db's hits came from, as vLLM's real ``Scheduler`` records them
(``vllm:prompt_tokens_cached_by_source``; audit of 2026-12, operator
controls finding 3).

vLLM 0.32 asks ``get_external_cache_hit_sources`` after
``update_state_after_alloc``, which used to clear the lookup's record: every
hit was reported as ``disk``, blocks fetched from the remote tier too. And a
remote fetch from block 0 was taken for none (``first_remote_block or ...``),
so a remote hit longer than one lookup segment (16 blocks) reported its first
segment as ``disk``. The split is now kept for the hit-sources question
(``RequestState.claimed``), whichever order it is asked in.

Real parts: vLLM's Scheduler with log stats on (its stats read from the
scheduler's outputs, as the engine's loggers read them), both halves of
ucm-db's connector, real stores and a ``file://`` remote tier; the model
runner is the stand-in of stand_in_engine.py.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

import stand_in_engine  # noqa: E402
from stand_in_engine import BS, StandInEngine  # noqa: E402

DISK, REMOTE = CacheHitSource.DISK, CacheHitSource.EXTERNAL_UNSPECIFIED
BLOCKS = 20  # past the lookup's first segment of 16 blocks (lookups.FIRST_SEGMENT_BLOCKS)
PROMPT = [(i * 7 + 3) % 97 for i in range(BLOCKS * BS + 5)]


class StatsEngine(StandInEngine):
    """A stand-in engine whose scheduler logs stats (``log_stats=True``);
    ``by_source`` sums the connector's ``hits_by_source`` of every step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert self.sched.log_stats and self.sched.connector_prefix_cache_stats is not None
        self.by_source: Counter[CacheHitSource] = Counter()
        self.hits = 0
        real = self.sched.update_from_output

        def update_from_output(so: Any, out: Any) -> Any:
            outputs = real(so, out)
            for eco in outputs.values():
                stats = eco.scheduler_stats and eco.scheduler_stats.connector_prefix_cache_stats
                if stats:
                    self.by_source.update(stats.hits_by_source)
                    self.hits += stats.hits
            return outputs

        self.sched.update_from_output = update_from_output  # type: ignore[method-assign]

    def serve(self, req_id: str, prompt: list[int]) -> None:
        self.sched.add_request(Request(req_id, prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), None,
                                       block_hasher=self.hasher))
        self.run()


@pytest.fixture()
def logging_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in engine's Scheduler made with ``log_stats=True``, as an engine logging stats makes it."""
    monkeypatch.setattr(stand_in_engine, "Scheduler", functools.partial(Scheduler, log_stats=True))


def _remote(root: Path) -> dict[str, Any]:
    return {"remote": f"file://{root / 'remote'}", "remote_mode": "write_through", "load_policy": "always"}


def _write(root: Path, store: Path, prompt: list[int], extra: dict[str, Any] | None = None) -> None:
    """An engine computes ``prompt`` and stores its blocks (and uploads them, given a remote)."""
    writer = StandInEngine(root, store, extra=extra)
    writer.add("w", prompt, 2)
    writer.run()
    writer.ours.store.flush()
    writer.close()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A remote tier holding all of PROMPT's blocks, uploaded by a writer engine."""
    root = tmp_path_factory.mktemp("hit-sources")
    (root / "remote").mkdir()
    _write(root, root / "writer", PROMPT, _remote(root))
    return root


CLAIM = BLOCKS * BS  # the prompt's whole blocks (its last token is computed)


@pytest.mark.usefixtures("logging_stats")
def test_a_remote_hit_from_block_0_is_reported_remote(root: Path) -> None:
    """An empty local tier: blocks 0-15 (the lookup's first segment) and
    16-19 are fetched from the remote; block 0 is where the remote hit starts."""
    reader = StatsEngine(root, root / "remote-only", extra=_remote(root))
    try:
        reader.serve("r", PROMPT)
        assert reader.hits == CLAIM
        assert dict(reader.by_source) == {REMOTE: CLAIM}  # was {DISK: 640}; {DISK: 512, REMOTE: 128} with block 0 taken for none
    finally:
        reader.close()


@pytest.mark.usefixtures("logging_stats")
def test_a_local_hit_is_reported_disk(root: Path) -> None:
    _write(root, root / "local-only", PROMPT)  # the local tier holds every block
    reader = StatsEngine(root, root / "local-only", extra=_remote(root))
    try:
        reader.serve("l", PROMPT)
        assert dict(reader.by_source) == {DISK: CLAIM}
    finally:
        reader.close()


@pytest.mark.usefixtures("logging_stats")
def test_a_mixed_hit_from_block_0_is_split(root: Path) -> None:
    """The local tier holds blocks 0-3, the remote the rest."""
    _write(root, root / "mixed", PROMPT[:4 * BS + 1])
    reader = StatsEngine(root, root / "mixed", extra=_remote(root))
    try:
        reader.serve("m", PROMPT)
        assert dict(reader.by_source) == {DISK: 4 * BS, REMOTE: CLAIM - 4 * BS}  # was {DISK: 640}
    finally:
        reader.close()
