"""Shared pytest options for the whole suite."""

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False, help="run soak / long crash modes (marker `long`)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long"):
        return
    skip_long = pytest.mark.skip(reason="long mode: run with --long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip_long)
