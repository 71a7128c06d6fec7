"""The connector shortens Python's thread switch interval, never lengthens
it, and refuses a setting outside 0-0.1 s (connector/gil_handoff.py)."""

from __future__ import annotations

import sys

import pytest

from ucm_db.connector.gil_handoff import DEFAULT_SWITCH_INTERVAL_S, shorten_switch_interval
from ucm_db.connector.settings import ConnectorSettings
from ucm_db.errors import ConfigError


@pytest.fixture(autouse=True)
def _restore_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_the_interval_is_only_ever_shortened() -> None:
    sys.setswitchinterval(0.005)
    assert shorten_switch_interval(0.0005) == pytest.approx(0.005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert shorten_switch_interval(0.002) is None, "a longer interval than the host's is never set"
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    sys.setswitchinterval(0.005)
    assert shorten_switch_interval(0) is None
    assert sys.getswitchinterval() == pytest.approx(0.005), "0 leaves the interval alone"


def test_the_setting_defaults_to_half_a_millisecond_and_refuses_nonsense(tmp_path) -> None:
    assert ConnectorSettings.from_extra_config({"path": str(tmp_path)}).switch_interval_s == DEFAULT_SWITCH_INTERVAL_S
    assert ConnectorSettings.from_extra_config({"path": str(tmp_path), "switch_interval_s": 0}).switch_interval_s == 0
    for bad in (-1, 0.5, "fast", True):
        with pytest.raises(ConfigError, match="switch_interval_s must be a number of seconds from 0 to 0.1") as raised:
            ConnectorSettings.from_extra_config({"path": str(tmp_path), "switch_interval_s": bad})
        assert "0 to leave Python's interval alone" in raised.value.hint
