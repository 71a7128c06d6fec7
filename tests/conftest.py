"""Shared pytest options and fixtures.

``--long`` enables the long soak / crash modes (marker ``long``); without it
those tests are deselected, and the README's test command runs the rest.

``--part 1`` keeps the tests that start vLLM (everything under ``tests/vllm``
and every test marked ``vllm``) and those of :data:`FIRST_PART_FOLDERS`;
``--part 2`` the others. ``dev.py test --two-parts`` runs the two parts at
once, one pytest each, so they share the machine's two cores (opt-in: the
README's command runs one process); the folders added to part 1 make the
two take about as long.

Where the collected modules imported vLLM, vLLM inspects model classes in
this process (tests/vllm_inspection.py): a new interpreter per architecture
otherwise.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

#: The values of ``--part``.
PARTS = ("1", "2")
TESTS = Path(__file__).resolve().parent
#: Part 1 besides the tests that start vLLM: the crash loops and the CLI (serial, at ba6a2a6: vLLM's tests about
#: 520 s, these about 275 s, the rest about 660 s; alone, vLLM's part ended at 10 min and the rest's at 21).
FIRST_PART_FOLDERS = (TESTS / "vllm", TESTS / "reliability", TESTS / "tools")


def in_first_part(item: pytest.Item) -> bool:
    """Whether a test belongs to ``--part 1``: marked ``vllm``, or under one
    of :data:`FIRST_PART_FOLDERS` (``tests/vllm``'s other tests fork its
    engine server or import vLLM), however the checkout's path was spelt
    (links resolved)."""
    return item.get_closest_marker("vllm") is not None or _under_first_part_folders(item.path.parent)


@functools.lru_cache(maxsize=None)
def _under_first_part_folders(folder: Path) -> bool:
    resolved = folder.resolve()
    return any(resolved == top or top in resolved.parents for top in FIRST_PART_FOLDERS)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False, help="run the long soak and crash modes too")
    parser.addoption("--part", choices=PARTS, default=None,
                     help="1: only the tests that start vLLM, tests/reliability and tests/tools; 2: only the others")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    long, part = config.getoption("--long"), config.getoption("--part")
    if long and part is None:
        return
    kept, dropped = [], []
    for item in items:
        wrong_part = part is not None and (part == "1") != in_first_part(item)
        (dropped if wrong_part or (not long and item.get_closest_marker("long")) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_collection_finish(session: pytest.Session) -> None:
    if "vllm" in sys.modules:
        from vllm_inspection import inspect_in_process

        inspect_in_process()


@pytest.fixture
def feed_from_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """New stores' change feeds start at seq 0, as stores of code before the
    random start did (ucm_db.index.changefeed.start): for tests that name
    seqs from 0. In this process only (a child process draws its start)."""
    from ucm_db.index import changefeed

    monkeypatch.setattr(changefeed, "start", lambda txn: 0)
