"""The LMDB engine maps the data file's cached pages into the process in
the background after open (ucm_db/engines/lmdb/prefault.py), so reads and
commits on a large store stop paying first-touch page faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import ucm_db
from ucm_db.engines.lmdb import prefault as lmdb_prefault
from ucm_db.engines.lmdb.prefault import resident_runs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prefaulting is Linux-only")
NS = ucm_db.Namespace(model="prefault-test", kv_dtype="bfloat16", block_size=4)
CHAINS, CHAIN_BLOCKS = 200, 100
BLOCK_BYTES = 128


def _chain(seed: int) -> list[bytes]:
    return list(NS.block_keys([seed * 1_000_000 + t for t in range(4 * CHAIN_BLOCKS)]))


def _fill(path) -> None:
    # 20,000 small blocks: B-tree pages spread over the file, as in a large store.
    with ucm_db.open(path, codec="none", capacity_bytes=1 << 30) as store:
        for seed in range(CHAINS):
            store.put(NS, _chain(seed), [bytes([seed % 251]) * BLOCK_BYTES] * CHAIN_BLOCKS, parent=None)


def test_resident_runs_coalesce_pages() -> None:
    page = lmdb_prefault._PAGE_BYTES
    assert list(resident_runs(bytes([1, 1, 0, 3, 0, 0, 1]), 1000)) == [(1000, 2 * page), (1000 + 3 * page, page), (1000 + 6 * page, page)]
    assert list(resident_runs(bytes(4), 0)) == []


def test_an_open_store_maps_its_cached_pages_and_stops_on_close(tmp_path) -> None:
    _fill(tmp_path)
    store = ucm_db.open(tmp_path)
    store.lookup(NS, NS.block_keys(list(range(8))))  # the environment opens lazily
    prefault = store._tier.engine.prefault
    assert prefault is not None and prefault.wait(30)
    assert prefault.gave_up == ""
    assert prefault.populated_pages >= 500  # just written: cached
    store.close()
    assert store._tier.engine.prefault is None


def test_a_store_closed_before_the_delay_never_prefaults(tmp_path) -> None:
    """vLLM's start-up check opens the store and closes it at once: no work."""
    _fill(tmp_path)
    store = ucm_db.open(tmp_path)
    store.lookup(NS, NS.block_keys(list(range(8))))
    prefault = store._tier.engine.prefault
    store.close()
    assert prefault is not None and prefault.wait(1) and prefault.populated_pages == 0 and prefault.gave_up == ""


def test_the_environment_variable_turns_it_off(tmp_path, monkeypatch) -> None:
    _fill(tmp_path)
    monkeypatch.setenv(lmdb_prefault.PREFAULT_ENV, "0")
    with ucm_db.open(tmp_path) as store:
        store.lookup(NS, NS.block_keys(list(range(8))))
        prefault = store._tier.engine.prefault
        assert prefault is not None and prefault.wait(5) and prefault.gave_up == "disabled" and prefault.populated_pages == 0


_READER = textwrap.dedent("""
    import json, resource, sys
    import ucm_db
    from tests.test_lmdb_prefault import CHAINS, NS, _chain
    chains = [_chain(seed) for seed in range(CHAINS)]
    store = ucm_db.open(sys.argv[1])
    store.lookup(NS, chains[0])
    prefault = store._tier.engine.prefault
    prefault.wait(30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    found = sum(store.lookup(NS, chain) for chain in chains)  # reads all over the B-trees
    print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, "gave_up": prefault.gave_up,
                      "found": found}))
    store.close()
""")


def _faults_of_a_full_read(path, prefault: str) -> dict:
    env = {**os.environ, lmdb_prefault.PREFAULT_ENV: prefault}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _READER, str(path)], env=env, capture_output=True, text=True, timeout=120,
                         check=True, cwd=root)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_reading_a_prefaulted_store_takes_almost_no_page_faults(tmp_path) -> None:
    _fill(tmp_path)
    cold = _faults_of_a_full_read(tmp_path, "0")
    warm = _faults_of_a_full_read(tmp_path, "1")
    assert warm["gave_up"] == ""
    assert cold["found"] == warm["found"] == CHAINS * CHAIN_BLOCKS
    assert cold["faults"] >= 100 and warm["faults"] * 4 < cold["faults"], (cold, warm)
