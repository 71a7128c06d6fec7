"""Shared pytest options and fixtures.

``--long`` enables the long soak / crash modes (marker ``long``); without it
those tests are deselected, and the README's test command runs the rest.

``--part engines`` keeps only the tests that start vLLM (everything under
``tests/vllm`` and every test marked ``vllm``), ``--part rest`` only the
others: ``dev.py test`` runs the two parts at once, one pytest each, so the
engines' start-ups and the rest share the machine's two cores.

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
PARTS = ("engines", "rest")
VLLM_TESTS = Path(__file__).resolve().parent / "vllm"


def starts_vllm(item: pytest.Item) -> bool:
    """Whether a test belongs to ``--part engines``: marked ``vllm``, or under
    ``tests/vllm`` (whose other tests fork its engine server or import vLLM),
    however the checkout's path was spelt (links resolved)."""
    return item.get_closest_marker("vllm") is not None or _under_vllm_tests(item.path.parent)


@functools.lru_cache(maxsize=None)
def _under_vllm_tests(folder: Path) -> bool:
    resolved = folder.resolve()
    return resolved == VLLM_TESTS or VLLM_TESTS in resolved.parents


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False, help="run the long soak and crash modes too")
    parser.addoption("--part", choices=PARTS, default=None,
                     help="only the tests that start vLLM (engines) or only the others (rest); default: all")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    long, part = config.getoption("--long"), config.getoption("--part")
    if long and part is None:
        return
    kept, dropped = [], []
    for item in items:
        wrong_part = part is not None and (part == "engines") != starts_vllm(item)
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
