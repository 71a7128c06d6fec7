"""Review of 74cf5da (``CommitProcessError.request_sent``), with a real
commit child, a real LMDB store and the writer's real void records.

Finding: :meth:`CommitProcess._call` checks for a gone child once *before*
its ``try`` (``self._check()`` at its top), so a request refused there
(the child found gone by another thread: a staging allocation, or another
engine's round on the shared committer) raises with the class default
``request_sent = True`` although not a byte of it was written. The route
then reports every key of the round as stored, and the round's void
deletes units another engine stored first: the over-report 74cf5da set out
to end. The second check, inside the ``try``, is right (False).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

import ucm_db  # noqa: E402
from ucm_db.committer import CommitProcess, SharedBuffer, SharedChain  # noqa: E402
from ucm_db.errors import CommitProcessError  # noqa: E402
from ucm_db.keys.units import UnitKeys  # noqa: E402

from test_audit_commit_route_fallbacks import (  # noqa: E402
    BLOCKS, NS, OPTIONS, UNIT_BYTES, _job, _other_engine_stores, _round, _route, _void, _wait_dead,
)


def _chain(committer: CommitProcess, tokens: list[int]) -> list[SharedChain]:
    keys = NS.block_keys(tokens)
    buffer = committer.share(len(keys) * UNIT_BYTES)
    _chain.keep.append(buffer)  # type: ignore[attr-defined]  # mapped until the test ends
    return [SharedChain(keys, buffer.id, 0, UNIT_BYTES, UNIT_BYTES)]


_chain.keep = []  # type: ignore[attr-defined]


def test_a_request_refused_because_the_child_is_known_gone_was_not_sent(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", **OPTIONS):
        committer = CommitProcess(tmp_path / "s", OPTIONS)
        first, second = _chain(committer, list(range(8))), _chain(committer, list(range(100, 108)))
        os.kill(committer.pid, signal.SIGKILL)
        _wait_dead(committer.pid)
        with pytest.raises(CommitProcessError) as found:  # the write finds it gone: nothing reached it
            committer.put_segments(NS, first)
        assert found.value.request_sent is False and not committer.alive
        with pytest.raises(CommitProcessError) as refused:  # never written at all
            committer.put_segments(NS, second)
        assert refused.value.request_sent is False, "a request never written reported as possibly committed"
        committer.close()


@dataclass
class _RacingJob:
    """A save job as the route reads one, whose staging, read by the route
    after its ``alive`` check, first lets the model's thread allocate a
    staging buffer (``committer.share``) that finds the child SIGKILLed:
    the interleaving of the writer's thread with the model's, made
    deterministic. No fault is faked: the child is really killed and
    really found gone by a real MAP write."""

    namespace: ucm_db.Namespace
    chains: tuple[UnitKeys, ...]
    real_staging: torch.Tensor
    buffer: SharedBuffer
    committer: CommitProcess
    raced: list[bool] = field(default_factory=list)

    @property
    def staging(self) -> torch.Tensor:
        if not self.raced:
            self.raced.append(True)
            os.kill(self.committer.pid, signal.SIGKILL)
            _wait_dead(self.committer.pid)
            with pytest.raises(CommitProcessError):
                self.committer.share(UNIT_BYTES)  # the model thread's allocation: stages in plain memory
            assert not self.committer.alive
        return self.real_staging


def test_a_round_refused_unsent_after_the_alive_check_keeps_the_other_engine_s_units(tmp_path: Path) -> None:
    with ucm_db.open(tmp_path / "s", **OPTIONS) as store:
        committer = CommitProcess(tmp_path / "s", OPTIONS)
        route = _route(store, committer)
        plain = _job(committer, list(range(4 * BLOCKS)), fill=0x55)
        job = _RacingJob(NS, plain.chains, plain.staging, plain.buffer, committer)
        theirs = _other_engine_stores(store, plain, 4)
        stored: list[bytes] = route.put(_round(job), None)  # type: ignore[arg-type]
        assert route.committer is None
        _void(store, plain, stored)
        assert store.get(NS, list(plain.chains[0][:4])) == [theirs] * 4, "the void deleted the other engine's units"
        ours = [plain.chains[0][4], *plain.chains[1]]
        assert sorted(stored) == sorted(ours)
        assert store.get(NS, ours) == [None] * len(ours)
        route.close()
