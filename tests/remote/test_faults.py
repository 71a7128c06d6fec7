"""Fault injection (ucmfault:// over memory://): a remote that is down,
slow, failing, truncating or bit-flipping gives misses and retries, never
wrong bytes and never a hang; lookups keep to their deadline."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

import ucm_db
from ucm_db.errors import TierError
from ucm_db.remote import keying
from ucm_db.remote.envelope import PROBE_BYTES
from ucm_db.remote.promotion import PromotionTarget
from faultfs import FaultPlan

from .conftest import chain

pytestmark = pytest.mark.timeout(60)
CAP = 64 << 20
DEADLINE_S = 0.2
#: Scheduling slack on a loaded 2-core machine.
SLACK_S = 0.5


@pytest.fixture
def root() -> str:
    return f"ucm-fault-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def plan() -> FaultPlan:
    plan = FaultPlan(seed=5, hang_s=20.0)
    yield plan
    plan.heal()  # release any request still hanging


def _seed_remote(tmp_path: Path, root: str, namespace, n_blocks: int) -> tuple[list[bytes], list[bytes]]:
    keys, payloads = chain(namespace, n_blocks)
    with ucm_db.open(tmp_path / "node-a", capacity_bytes=CAP, remote=f"memory://{root}") as node_a:
        node_a.put(namespace, keys, payloads)
        node_a.flush(upload_timeout_s=30)
    return keys, payloads


def _faulty(tmp_path: Path, root: str, plan: FaultPlan, name: str = "node-b", **options) -> ucm_db.Store:
    options.setdefault("remote_deadline_s", DEADLINE_S)
    return ucm_db.open(
        tmp_path / name, capacity_bytes=CAP, remote=f"ucmfault://{root}",
        remote_options={"target_protocol": "memory", "plan": plan}, **options,
    )


def test_remote_down_lookup_keeps_deadline_and_local_hits(tmp_path: Path, root: str, plan: FaultPlan, namespace) -> None:
    keys, payloads = _seed_remote(tmp_path, root, namespace, 20)
    with _faulty(tmp_path, root, plan) as node_b:
        node_b.put(namespace, keys[:5], payloads[:5])
        plan.take_down()
        for _ in range(5):
            started = time.monotonic()
            assert node_b.lookup(namespace, keys) == 5
            assert time.monotonic() - started < DEADLINE_S + SLACK_S
        assert node_b.get(namespace, keys[:5]) == payloads[:5]  # local hits still served
        started = time.monotonic()
        assert node_b.get(namespace, keys[5:8]) == [None] * 3  # breaker open: no wait
        assert time.monotonic() - started < 10 * DEADLINE_S + SLACK_S
        assert plan.injected.get("hang", 0) > 0
        plan.heal()
        end = time.monotonic() + 10
        while node_b.lookup(namespace, keys) < 20 and time.monotonic() < end:
            time.sleep(0.05)  # the breaker lets a request through after its backoff
        assert node_b.lookup(namespace, keys) == 20
        assert node_b.get(namespace, keys) == payloads


def test_flaky_reads_give_misses_never_wrong_bytes(tmp_path: Path, root: str, plan: FaultPlan, namespace) -> None:
    keys, payloads = _seed_remote(tmp_path, root, namespace, 30)
    plan.read_error_rate, plan.timeout_rate, plan.truncate_rate, plan.bitflip_rate = 0.1, 0.05, 0.15, 0.15
    with _faulty(tmp_path, root, plan) as node_b:
        for attempt in range(40):
            count = node_b.lookup(namespace, keys)
            got = node_b.get(namespace, keys)
            for value, expected in zip(got, payloads):
                assert value is None or value == expected
            assert node_b.get(namespace, keys[:count]) == payloads[:count]
            if count == len(keys):
                break
            time.sleep(0.02)
        assert plan.injected.get("bitflip", 0) + plan.injected.get("truncate", 0) > 0
        assert node_b.stats().remote["corrupt"] > 0
        plan.clear()
        end = time.monotonic() + 10
        while node_b.lookup(namespace, keys) < len(keys) and time.monotonic() < end:
            time.sleep(0.05)
        assert node_b.get(namespace, keys) == payloads
        assert node_b._tier.check() == []


def test_failing_uploads_retry_until_the_remote_has_everything(tmp_path: Path, root: str, plan: FaultPlan, namespace) -> None:
    keys, payloads = chain(namespace, 40)
    plan.write_error_rate, plan.timeout_rate = 0.4, 0.05
    with _faulty(tmp_path, root, plan, name="writer") as store:
        store.put(namespace, keys, payloads)
        store.flush(upload_timeout_s=40)
        assert store.stats().remote["failures"] > 0
    with ucm_db.open(tmp_path / "reader", capacity_bytes=CAP, remote=f"memory://{root}", remote_deadline_s=5.0) as reader:
        assert reader.lookup(namespace, keys) == 40
        assert reader.get(namespace, keys) == payloads


def test_remote_down_queue_is_kept_and_drains_after(tmp_path: Path, root: str, plan: FaultPlan, namespace,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Each open of a store whose remote hangs waits MARKER_WAIT_S (10 s) for its markers; not what this test checks.
    monkeypatch.setattr(keying, "MARKER_WAIT_S", 1.0)
    keys, payloads = chain(namespace, 12)
    plan.take_down()
    with _faulty(tmp_path, root, plan, name="writer") as store:
        store.put(namespace, keys, payloads)
        with pytest.raises(TierError, match="still waiting for upload"):
            store.flush(upload_timeout_s=0.3)
        assert store.stats().pending_uploads == 12
    # Reopen while still down: the queue is durable, nothing was dropped.
    with _faulty(tmp_path, root, plan, name="writer") as store:
        assert store.stats().pending_uploads == 12
        assert store.get(namespace, keys) == payloads
        plan.heal()
        store.flush(upload_timeout_s=30)
        assert store.stats().pending_uploads == 0


def test_write_through_failure_keeps_blocks_queued(tmp_path: Path, root: str, plan: FaultPlan, namespace) -> None:
    keys, payloads = chain(namespace, 4)
    plan.write_error_rate = 1.0
    with _faulty(tmp_path, root, plan, name="writer", remote_mode="write_through") as store:
        with pytest.raises(TierError, match="write-through"):
            store.put(namespace, keys, payloads)
        assert store.get(namespace, keys) == payloads  # committed locally
        assert store.stats().pending_uploads == 4
        plan.clear()
        store.flush(upload_timeout_s=30)
        assert store.stats().pending_uploads == 0


def test_lookup_cut_by_deadline_finishes_in_the_background(tmp_path: Path, root: str, plan: FaultPlan, namespace) -> None:
    n_blocks = 240
    keys, payloads = _seed_remote(tmp_path, root, namespace, n_blocks)
    deadline_s = 1.0
    with _faulty(tmp_path, root, plan, remote_deadline_s=deadline_s) as node_b:
        node_b.epoch(namespace)  # first contact made before the latency: the lookup's deadline is all the fetch's
        # 240 fetches, 16 at a time: 15 waves of 0.2 s, 3 s in all, so a lookup
        # that waited for them would overrun the bound below (2 s, a second of
        # scheduling slack); the search's one round (0.2 s) leaves 0.8 s of
        # the deadline for a loaded machine (a search cut by it finds nothing
        # to continue).
        plan.latency_s = 0.2
        started = time.monotonic()
        first = node_b.lookup(namespace, keys)
        assert time.monotonic() - started < deadline_s + 2 * SLACK_S < n_blocks / 16 * plan.latency_s
        assert first < n_blocks
        end = time.monotonic() + 20
        while node_b._tier.count_prefix(keys) < n_blocks and time.monotonic() < end:
            time.sleep(0.05)  # no further lookups: the background promotion fills it
        assert node_b._tier.count_prefix(keys) == n_blocks
        assert node_b._wing.continuations.promoted_in_background == n_blocks - first
        assert node_b.get(namespace, keys) == payloads
        assert node_b._tier.check() == []


def test_short_lookup_cut_by_deadline_finishes_in_the_background(tmp_path: Path, root: str, plan: FaultPlan, namespace) -> None:
    """The direct fetch of a short continuation (no search first) cut by the
    deadline: the lookup returns what arrived, the rest is promoted later.

    The deadline is a wall-clock time: on a loaded host the first wave can
    miss it too (nothing arrived: 0 blocks, which proves nothing here), so the
    scenario runs again at a longer time scale, on a fresh node, until a
    wave lands inside the deadline. A lookup that never returns a part fails
    at every scale."""
    from ucm_db.remote import promotion

    n_blocks = promotion.DIRECT_FETCH_KEYS
    keys, payloads = _seed_remote(tmp_path, root, namespace, n_blocks)
    for attempt, deadline_s in enumerate((1.0, 3.0, 8.0)):
        plan.latency_s = 0.0
        with _faulty(tmp_path, root, plan, name=f"node-b{attempt}", remote_read_concurrency=4,
                     remote_deadline_s=deadline_s) as node_b:  # 4 waves
            node_b.epoch(namespace)  # first contact made before the latency
            plan.latency_s = deadline_s / 2.5  # the deadline passes in the third wave; the first has 0.6 of it to spare
            first = node_b.lookup(namespace, keys)
            assert first < n_blocks
            if first == 0 and deadline_s < 8.0:
                continue  # the host was too slow for even the first wave: a longer time scale
            assert first > 0
            end = time.monotonic() + 20 + 2 * deadline_s
            while node_b._tier.count_prefix(keys) < n_blocks and time.monotonic() < end:
                time.sleep(0.05)
            assert node_b._tier.count_prefix(keys) == n_blocks
            assert node_b._wing.continuations.promoted_in_background == n_blocks - first
            assert node_b.get(namespace, keys) == payloads
            assert node_b._tier.check() == []
            return


def test_short_lookup_of_a_down_remote_leaves_nothing_to_continue(tmp_path: Path, root: str, plan: FaultPlan, namespace) -> None:
    """A direct fetch the remote never answers (down: requests hang) is a
    miss within the deadline and queues no background promotion: with the
    breaker open, later lookups skip the remote at once."""
    keys, _payloads = _seed_remote(tmp_path, root, namespace, 12)
    with _faulty(tmp_path, root, plan) as node_b:
        node_b.epoch(namespace)  # first contact made: the lookups do try the remote
        plan.take_down()
        for _ in range(3):
            started = time.monotonic()
            assert node_b.lookup(namespace, keys) == 0
            assert time.monotonic() - started < DEADLINE_S + SLACK_S
        assert plan.injected.get("hang", 0) > 0  # the direct fetch was tried
        plan.heal()  # hung requests return now: a queued continuation would promote them
        time.sleep(0.5)
        assert node_b._wing.continuations.promoted_in_background == 0
        assert node_b._tier.count_prefix(keys) == 0


def test_lookup_commits_a_bounded_amount_and_promotes_the_rest_in_background(
    tmp_path: Path, root: str, plan: FaultPlan, namespace, monkeypatch,
) -> None:
    from ucm_db.remote import promotion

    keys, payloads = _seed_remote(tmp_path, root, namespace, 30)
    monkeypatch.setattr(promotion, "SYNC_PROMOTE_BYTES", 1)  # one block per lookup commit
    with _faulty(tmp_path, root, plan, remote_deadline_s=5.0) as node_b:
        assert node_b.lookup(namespace, keys) == 1
        end = time.monotonic() + 20
        while node_b._tier.count_prefix(keys) < 30 and time.monotonic() < end:
            time.sleep(0.05)
        assert node_b._tier.count_prefix(keys) == 30
        assert node_b.get(namespace, keys) == payloads
        assert node_b._tier.check() == []


def test_the_product_does_not_know_the_fault_protocol() -> None:
    """``ucmfault://`` is the tests' (tests/faultfs.py): no shipped module
    names it, and importing every core module registers nothing under it."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    shipped = [p for folder in ("ucm_db", "connector", "tools", "migrations") for p in (root / folder).rglob("*.py")]
    assert len(shipped) > 20
    assert [str(p.relative_to(root)) for p in shipped if "ucmfault" in p.read_text()] == []
    code = (
        "import importlib, pkgutil, fsspec, ucm_db\n"
        "for m in pkgutil.walk_packages(ucm_db.__path__, 'ucm_db.'):\n"
        "    if m.name.split('.')[1] not in ('connector', 'tools', 'migrations'):\n"
        "        importlib.import_module(m.name)\n"
        "print('ucmfault' in fsspec.registry)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_fetch_left_no_time_by_its_search_still_finishes_in_the_background(
    tmp_path: Path, root: str, plan: FaultPlan, namespace,
) -> None:
    """The search answers within the deadline and finds every block; the
    fetch after it cannot answer in the time left. That silence is not the
    remote's failure (it just answered): the breaker stays closed, and the
    background continuation fetches every block (it used to stop on the
    breaker the fetch had opened: nothing was ever promoted)."""
    n_blocks = 40  # more than a direct fetch takes: searched first
    keys, payloads = _seed_remote(tmp_path, root, namespace, n_blocks)
    with _faulty(tmp_path, root, plan, remote_deadline_s=1.0) as node_b:
        node_b.epoch(namespace)  # first contact made before the latency
        plan.latency_s = 0.6  # one search round fits the 1 s deadline; a fetch round after it does not
        assert node_b.lookup(namespace, keys) == 0
        search = node_b._wing.link.last_search
        assert search is not None and search.complete and search.count == n_blocks
        assert node_b.stats().remote["breaker_trips"] == 0
        end = time.monotonic() + 20
        while node_b._tier.count_prefix(keys) < n_blocks and time.monotonic() < end:
            time.sleep(0.05)  # no further lookups: the background promotion fills it
        assert node_b._tier.count_prefix(keys) == n_blocks
        assert node_b._wing.continuations.promoted_in_background == n_blocks
        assert node_b.get(namespace, keys) == payloads


def test_continuation_waits_out_an_open_breaker(tmp_path: Path, root: str, plan: FaultPlan, namespace) -> None:
    """A continuation queued while the breaker is open (another lookup's
    failure) waits out the backoff, then fetches, instead of dropping a
    prefix found present. The breaker is opened by hand here: a fault
    between one lookup's search and its continuation cannot be timed."""
    n_blocks = 40
    keys, payloads = _seed_remote(tmp_path, root, namespace, n_blocks)
    with _faulty(tmp_path, root, plan) as node_b:
        link = node_b._wing.link
        for _ in range(3):
            link.breaker.failure()  # backoff 0.05, 0.1, then 0.2 s
        assert link.breaker.open_for_s() > 0.1
        assert node_b._wing.continuations.continue_later(
            node_b._tier, PromotionTarget(namespace, node_b._epochs.before_put), list(keys), None)
        end = time.monotonic() + 20
        while node_b._tier.count_prefix(keys) < n_blocks and time.monotonic() < end:
            time.sleep(0.05)
        assert node_b._tier.count_prefix(keys) == n_blocks
        assert node_b.get(namespace, keys) == payloads


def test_first_contact_slower_than_the_deadline_is_not_a_failure(
    tmp_path: Path, root: str, plan: FaultPlan, namespace, caplog: pytest.LogCaptureFixture,
) -> None:
    """The first request to a remote (an object store's session set-up) may
    outlast a lookup's deadline with nothing wrong: the lookup keeps its
    deadline and serves what is local, the manifest read goes on, and the
    lookups after it read through at once (before: the breaker opened and
    nothing was read through for 5 s, with a warning)."""
    keys, payloads = _seed_remote(tmp_path, root, namespace, 8)
    plan.latency_s = 0.5  # the manifest read outlasts the 0.2 s deadline
    with _faulty(tmp_path, root, plan) as node_b:
        started = time.monotonic()
        assert node_b.lookup(namespace, keys) == 0
        assert time.monotonic() - started < DEADLINE_S + SLACK_S
        plan.latency_s = 0.0  # the read already running keeps its 0.5 s
        started = time.monotonic()
        node_b.lookup(namespace, keys)  # finds the read running, older than its deadline: no wait
        assert time.monotonic() - started < 0.1
        end = time.monotonic() + 3  # well inside the 5 s a failed first contact waits
        while node_b.lookup(namespace, keys) < len(keys) and time.monotonic() < end:
            time.sleep(0.05)
        assert node_b.lookup(namespace, keys) == len(keys)
        assert node_b.get(namespace, keys) == payloads
        assert node_b.stats().remote["breaker_trips"] == 0
    assert "cannot read the remote's epoch" not in caplog.text


def test_lookup_with_a_longer_deadline_waits_for_first_contact(tmp_path: Path, root: str, plan: FaultPlan, namespace) -> None:
    """A lookup's own ``remote_deadline_s`` covers first contact too (it
    used to get the store's 0.2 s for it, and miss)."""
    keys, payloads = _seed_remote(tmp_path, root, namespace, 8)
    plan.latency_s = 0.5
    with _faulty(tmp_path, root, plan) as node_b:
        assert node_b.lookup(namespace, keys, remote_deadline_s=10.0) == len(keys)
        assert node_b.get(namespace, keys) == payloads


def test_get_and_warm_wait_for_first_contact_as_bulk_steps(tmp_path: Path, root: str, plan: FaultPlan, namespace) -> None:
    """``get`` (read-through of local misses) and ``warm`` wait on the
    remote up to their bulk deadline (ten lookup deadlines), first contact
    included: a manifest read slower than one lookup deadline does not make
    the get miss, nor the warm key its prompts at this store's epoch when
    the remote's is higher."""
    keys, payloads = _seed_remote(tmp_path, root, namespace, 8)
    tokens = list(range(8 * namespace.block_size))
    with ucm_db.open(tmp_path / "node-a", capacity_bytes=CAP, remote=f"memory://{root}") as node_a:
        epoch = node_a.bump_epoch(namespace)  # the remote's manifest carries it
        at_epoch = namespace.block_keys(tokens, epoch=epoch)
        node_a.put(namespace, at_epoch, payloads)
        node_a.flush(upload_timeout_s=30)
    plan.latency_s = 0.5  # over the 0.2 s lookup deadline, under the 2 s bulk one
    with _faulty(tmp_path, root, plan, name="getter") as getter:
        assert getter.get(namespace, keys) == payloads
    with _faulty(tmp_path, root, plan, name="warmer") as warmer:
        report = warmer.warm(namespace, token_sequences=[tokens])  # keyed at the remote's epoch, not 0
        assert warmer.lookup(namespace, at_epoch, remote=False) == len(at_epoch), report


def test_a_fetch_after_a_search_that_stays_silent_opens_the_breaker(
    tmp_path: Path, root: str, plan: FaultPlan, namespace,
) -> None:
    """Probes answer but whole-object fetches do not, though they had more
    time than a search round took: that silence is the remote's, and the
    breaker opens, so later lookups skip it during the backoff."""
    keys, _payloads = _seed_remote(tmp_path, root, namespace, 40)
    with _faulty(tmp_path, root, plan, remote_deadline_s=1.0) as node_b:
        node_b.epoch(namespace)
        plan.slow_read_bytes, plan.slow_read_s = PROBE_BYTES, 3.0  # probes answer at once, fetches after the deadline
        assert node_b.lookup(namespace, keys) == 0
        assert plan.injected.get("slow_read", 0) > 0
        search = node_b._wing.link.last_search
        assert search is not None and search.complete and search.count == 40
        assert node_b.stats().remote["breaker_trips"] == 1


def test_a_first_contact_read_that_never_answers_is_given_up(
    tmp_path: Path, root: str, plan: FaultPlan, namespace, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A manifest read hung on a dead connection is pending only up to
    PENDING_LIMIT_S (shortened here): then it is a failure, warned about,
    the breaker opens and first contact is retried later."""
    from ucm_db.remote import first_contact

    monkeypatch.setattr(first_contact, "PENDING_LIMIT_S", 1.0)
    keys, _payloads = _seed_remote(tmp_path, root, namespace, 4)
    with _faulty(tmp_path, root, plan) as node_b:
        plan.take_down()  # every request hangs (up to hang_s, 20 s)
        assert node_b.lookup(namespace, keys) == 0  # pending: no warning yet
        assert "cannot read the remote's epoch" not in caplog.text
        time.sleep(1.1)
        started = time.monotonic()
        assert node_b.lookup(namespace, keys) == 0  # given up: no wait
        assert time.monotonic() - started < DEADLINE_S + SLACK_S
        assert "did not answer in 1 s" in caplog.text
        assert node_b.stats().remote["breaker_trips"] >= 1
        plan.heal()


def test_a_read_of_local_blocks_never_waits_on_first_contact(tmp_path: Path, root: str, plan: FaultPlan, namespace) -> None:
    """A get (a worker's load) whose blocks are all local asks the remote
    nothing, first contact included, however slow that is."""
    keys, payloads = chain(namespace, 8)
    with _faulty(tmp_path, root, plan, name="writer") as store:
        plan.latency_s = 1.0  # first contact (started by the put) takes 1 s
        store.put(namespace, keys, payloads)
        started = time.monotonic()
        assert store.get(namespace, keys) == payloads
        assert time.monotonic() - started < 0.1
        plan.latency_s = 0.0
