"""Review 3 of 25011b0 (gc keeps an unreadable object): the size rule
counts an unreadable object's bytes as freed, though gc never removes it.

An S3 lifecycle rule moves the *oldest* objects to GLACIER, so the
unreadable objects are the oldest leaves, which ``oldest_tails`` picks
first: ``--max-bytes`` then removes nothing at all (or far too little), the
remote stays over its budget run after run, and the report says nothing of
the shortfall (no ``held_*``; only "N unreadable kept"). Pure planning code
(``plan_removals``) on listed objects as ``list_objects`` returns them for
an archived object (``read_error`` set, parent unknown): no mock.
"""

from __future__ import annotations

import pytest

from ucm_db.remote.gc import plan_removals, shortfall_reason
from ucm_db.remote.gc_listing import RemoteObjectInfo

NOW_S = 1_700_000_000.0
DAY_S = 86400.0


def _obj(tag: int, namespace: str, age_days: float, *, parent: int | None = None,
         read_error: str | None = None) -> RemoteObjectInfo:
    key = bytes([tag]) * 32
    return RemoteObjectInfo(f"root/{namespace}/{key[:1].hex()}/{key.hex()}", key, 100, NOW_S - age_days * DAY_S,
                            parent=bytes([parent]) * 32 if parent is not None else None, read_error=read_error)


def test_size_rule_frees_its_excess_from_removable_objects() -> None:
    objects = [
        _obj(1, "aa11", 90, read_error="OSError: InvalidObjectState (GLACIER)"),  # archived by a lifecycle rule
        _obj(2, "bb22", 30),  # two readable one-block chains in another namespace
        _obj(3, "bb22", 1),
    ]
    plan = plan_removals(objects, older_than_s=None, max_bytes=200, now_s=NOW_S)  # 300 bytes listed: 100 too many
    freed = sum(o.size_bytes for o in objects if o.path in plan.victims | plan.cascade)
    assert freed >= 100, f"removed {freed} bytes of the 100 over budget; victims {plan.victims}, held {plan.held}"
    assert plan.victims == {objects[1].path} and not plan.held and plan.short_bytes == 0  # the oldest readable tail only


def test_a_target_only_unreadable_objects_stand_in_the_way_of_is_reported() -> None:
    """Every readable object goes; the archived ones are all that is left
    over the budget: the plan says how short it fell, and gc's report why."""
    objects = [
        _obj(1, "aa11", 90, read_error="OSError: InvalidObjectState (GLACIER)"),
        _obj(2, "aa11", 80, read_error="OSError: InvalidObjectState (GLACIER)"),
        _obj(3, "bb22", 1),
    ]
    plan = plan_removals(objects, older_than_s=None, max_bytes=50, now_s=NOW_S)
    assert plan.victims == {objects[2].path} and plan.short_bytes == 150 and sorted(plan.unreadable) == sorted(
        o.path for o in objects[:2])
    reason = shortfall_reason(objects, plan, 200, 50)
    assert reason is not None and "150 bytes over --max-bytes" in reason and "2 unreadable objects (200 bytes)" in reason


def test_an_age_rule_victim_that_is_unreadable_is_not_counted_as_freed() -> None:
    """The age rule takes an archived chain; its bytes stay on the remote,
    so the size rule still trims the young namespace to the budget."""
    objects = [
        _obj(1, "aa11", 90, read_error="OSError: InvalidObjectState (GLACIER)"),
        _obj(2, "bb22", 3),
        _obj(3, "bb22", 2, parent=2),
        _obj(4, "bb22", 1),
    ]
    plan = plan_removals(objects, older_than_s=30 * DAY_S, max_bytes=250, now_s=NOW_S)  # 400 listed; 100 kept unreadable
    # 150 bytes over among the readable: both blocks of the older chain (before: its tail alone, 50 bytes short,
    # the archived object's 100 bytes counted as freed)
    assert plan.victims == {objects[1].path, objects[2].path} and not plan.held and plan.short_bytes == 0, plan
