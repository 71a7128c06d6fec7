"""The scheduler's stale-block tracker (connector/scheduler/stale_blocks.py),
step by step: which requests of a step read stale KV, which blocks the
workers report, and how slots written again stop being stale.

The engine-level scenarios (vLLM's real scheduler, a real store) are in
test_review_load_path.py and test_stale_blocks_randomised.py; these pin the
tracker's rules one at a time. Block size 4; the loader A failed blocks
10-11 (its table 9, 10, 11, 12), shared whole by R2 (table 9, 10, 11, 12, 20).
"""

from __future__ import annotations

from ucm_db.connector.scheduler.stale_blocks import Scheduled, StaleBlocks

BS = 4
A_TABLE = (9, 10, 11, 12)
R2_TABLE = (9, 10, 11, 12, 20)


def _after_failure() -> StaleBlocks:
    """A's load of blocks 10-11 failed: they and every later block of the tables holding them are stale."""
    stale = StaleBlocks(BS)
    stale.went_stale({10, 11, 12, 20})
    return stale


def test_nothing_is_judged_until_a_block_goes_stale() -> None:
    stale = StaleBlocks(BS)
    verdict = stale.plan(0, [Scheduled("A", A_TABLE, 4, 16)], loaded=())
    assert stale.empty and verdict.stale_reads == () and not verdict.tainted


def test_a_sharer_whose_loader_rewrites_only_part_of_a_block_is_tainted() -> None:
    """A (rewound to block 10) recomputes 2 tokens (a chunk below the block);
    R2, holding blocks 9-12 as computed, reads the rest of 10 and all of 11-12."""
    stale = _after_failure()
    verdict = stale.plan(1, [Scheduled("A", A_TABLE, 4, 6), Scheduled("R2", R2_TABLE, 16, 17)], loaded=())
    assert verdict.tainted == {"R2"}
    assert verdict.stale_reads == (10, 11, 12)
    assert stale.output_back(1) == verdict and stale.output_back(1).tainted == frozenset()


def test_a_loader_that_rewrites_every_shared_block_in_the_step_taints_nobody() -> None:
    """vLLM's own assumption: KV written in the step is there for every
    request's attention in it, whatever order the step lists them in."""
    stale = _after_failure()
    verdict = stale.plan(1, [Scheduled("R2", R2_TABLE, 16, 17), Scheduled("A", A_TABLE, 4, 16)], loaded=())
    assert not verdict.tainted and verdict.stale_reads == ()
    assert stale.output_back(1).tainted == frozenset()


def test_a_chunked_recompute_is_never_tainted_by_its_own_progress() -> None:
    """A rewrites block 10 two slots a step: it reads only what it wrote, so
    it is never reported (vLLM would rewind it to the block's start and it
    would never finish)."""
    stale = _after_failure()
    for step, computed in enumerate(range(4, 16, 2)):
        verdict = stale.plan(step, [Scheduled("A", A_TABLE, computed, computed + 2)], loaded=())
        assert not verdict.tainted, f"step {step}: A at token {computed}"
    assert {10, 11} & set(_stale_reads_of(stale, Scheduled("R2", R2_TABLE, 12, 13))) == set()


def _stale_reads_of(stale: StaleBlocks, part: Scheduled) -> tuple[int, ...]:
    return stale.plan(99, [part], loaded=()).stale_reads


def test_a_tainted_requests_writes_go_stale() -> None:
    """R2's block 20, written over stale blocks, is stale even where it had been clean."""
    stale = StaleBlocks(BS)
    stale.went_stale({10})
    stale.plan(1, [Scheduled("R2", R2_TABLE, 16, 18)], loaded=())
    reader = Scheduled("R3", (9, 10, 11, 12, 20), 18, 19)  # as if it shared R2's block 20
    assert 20 in _stale_reads_of(stale, reader)


def test_a_rewound_sharer_writes_its_blocks_clean_again() -> None:
    """After vLLM rewinds R2 to block 10, its own recompute cleans 10-12 and 20: nothing is stale any more."""
    stale = _after_failure()
    stale.plan(1, [Scheduled("R2", R2_TABLE, 4, 18)], loaded=())
    assert _stale_reads_of(stale, Scheduled("R2", R2_TABLE, 18, 19)) == ()
    stale.plan(2, [Scheduled("R2", R2_TABLE, 18, 20)], loaded=())
    assert stale.empty  # block 20 whole too: slots nobody wrote yet were never read


def test_a_block_loaded_in_the_step_is_clean_and_a_freed_one_forgotten() -> None:
    stale = _after_failure()
    verdict = stale.plan(1, [Scheduled("B", (10, 30), 4, 5)], loaded=[10])  # 10 freed, given to B, loaded whole
    assert not verdict.tainted
    stale.forget_freed(lambda block_id: block_id in {11, 12, 20})
    assert stale.empty


def test_draft_tokens_clean_nothing() -> None:
    """Slots of scheduled tokens whose ids are not known yet (speculative drafts) are written again later."""
    stale = StaleBlocks(BS)
    stale.went_stale({20})
    stale.plan(1, [Scheduled("R2", R2_TABLE, 16, 16)], loaded=())  # 3 draft tokens scheduled, none known
    assert _stale_reads_of(stale, Scheduled("R3", R2_TABLE, 18, 19)) == (20,)


def test_only_steps_with_a_tainted_request_keep_a_verdict() -> None:
    stale = _after_failure()
    stale.plan(1, [Scheduled("C", (40, 41), 4, 5)], loaded=())
    assert stale.output_back(1).stale_reads == () and stale.output_back(None).tainted == frozenset()


def test_a_tainted_requests_writes_are_stale_to_every_request_of_its_step() -> None:
    """R2 (tainted: it reads blocks 10-12 stale) fills its block 20 in the
    step; W2, admitted in the same step with 20 as a local hit, reads it in
    the same forward pass: tainted too, and 20 is among the stale reads."""
    stale = StaleBlocks(BS)
    stale.went_stale({10, 11, 12})  # 20 is fresh before the step: R2 fills it now
    w2_table = (9, 40, 41, 42, 20)  # clean blocks but R2's 20
    verdict = stale.plan(1, [Scheduled("W2", w2_table, 20, 21), Scheduled("R2", R2_TABLE, 16, 20)], loaded=())
    assert verdict.tainted == {"R2", "W2"} and 20 in verdict.stale_reads
    assert set(verdict.tables) == {R2_TABLE, w2_table}  # evicted from vLLM's prefix cache at the step's output


def test_a_freed_stale_block_is_returned_to_be_evicted() -> None:
    stale = _after_failure()
    assert stale.forget_freed(lambda block_id: block_id == 20) == {20}
    assert not stale.empty
