"""A callable's namespace identity (connector/callables.py): the same in
every interpreter (the scheduler's and workers' processes; string hashing
randomised per process), different for callables that compute differently
(partials of other arguments, closures over other values, other code), and
never an address."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

from ucm_db.connector.callables import callable_identity

SCRIPT = """
import functools, json, sys
sys.path.insert(0, sys.argv[1])
from test_callable_identity import FUNCTIONS
from ucm_db.connector.callables import callable_identity
print(json.dumps([callable_identity(f) for f in FUNCTIONS]))
"""


def rope(theta: float, config: object) -> object:
    return config


def closure(theta: float):  # type: ignore[no-untyped-def]
    labels = frozenset({"a", "b", "c"})
    return lambda config: (theta, labels, config)


FUNCTIONS = [functools.partial(rope, 1.0), functools.partial(rope, 2.0), closure(1.0), closure(2.0),
             lambda config: config, lambda config: None, functools.partial(rope, object())]


def test_identities_differ_where_the_computation_does_and_agree_across_processes() -> None:
    here = [callable_identity(f) for f in FUNCTIONS]
    assert len({json.dumps(i, sort_keys=True) for i in here[:6]}) == 6
    assert "0x" not in json.dumps(here)  # no address: a bound object is named by its type
    for _ in range(2):  # other interpreters, other string-hash seeds
        out = subprocess.run([sys.executable, "-c", SCRIPT, __file__.rsplit("/", 1)[0]], capture_output=True, text=True,
                             check=True, env={"PYTHONHASHSEED": "random", "PATH": "/usr/bin"})
        assert json.loads(out.stdout) == json.loads(json.dumps(here))
