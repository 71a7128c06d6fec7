"""Shared pytest options and fixtures.

``--long`` enables the long soak / crash modes (marker ``long``); without it
those tests are deselected, and the README's test command runs the rest.

Where the collected modules imported vLLM, vLLM inspects model classes in
this process (tests/vllm_inspection.py): a new interpreter per architecture
otherwise.
"""

from __future__ import annotations

import sys

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False, help="run the long soak and crash modes too")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long"):
        return
    kept, dropped = [], []
    for item in items:
        (dropped if item.get_closest_marker("long") else kept).append(item)
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
