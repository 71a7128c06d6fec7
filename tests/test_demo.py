"""The demo's checks and headline: exact first tokens, near-ties, real
differences; the headline compares the restarted engines with and without
ucm-db (passes 2 and 3), not pass 1."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from ucm_db.tools.demo import NEAR_TIE_LOGPROB, compare_first_tokens, exit_status, main, print_headline


def _run(tokens: list[int], tops: list[dict[int, float]]) -> dict[str, object]:
    return {"first_tokens": tokens, "top_logprobs": [{str(k): v for k, v in top.items()} for top in tops]}


def test_same_near_tie_and_different_are_told_apart() -> None:
    first = _run([7, 7, 7, 7], [{7: -2.000, 9: -2.001, 3: -4.0}] * 4)
    second = _run([7, 9, 3, 12], [
        {7: -2.000, 9: -2.001},   # same token
        {9: -2.000, 7: -2.002},   # a flip between two tokens pass 1 scored 0.001 apart
        {3: -1.0, 7: -3.0},       # a flip to a token pass 1 scored 2 nats lower: wrong KV
        {12: -1.0, 5: -2.0},      # a token pass 1 did not have in its top 5
    ])
    verdicts = compare_first_tokens(first, second)
    assert verdicts[0] == "same"
    assert verdicts[1].startswith("near-tie") and NEAR_TIE_LOGPROB > 0.001
    assert verdicts[2:] == ["DIFFERENT", "DIFFERENT"]
    assert exit_status(verdicts) == 1 and exit_status(verdicts[:2]) == 0  # README: exits 1 if a first token differs


def test_headline_compares_restarted_engines_with_and_without_ucm_db(capsys: pytest.CaptureFixture[str]) -> None:
    prompts = [[1] * 100] * 4
    # Pass 3 (no ucm-db): prompts 0 and 1 recompute everything, 2 and 3 hit vLLM's own cache.
    without = {"ttft_s": [3.0, 2.8, 0.4, 0.6], "cached": [0, 0, 64, 64]}
    with_ucm = {"ttft_s": [0.2, 0.1, 0.1, 0.2], "cached": [0, 0, 64, 64], "ucm_hits": [(0, 96), (0, 96), (64, 32), (64, 32)]}
    print_headline(prompts, with_ucm, without)
    out = capsys.readouterr().out
    # medians: without 1700 ms (0.4, 0.6, 2.8, 3.0), with 150 ms (0.1, 0.1, 0.2, 0.2): 11.33x
    assert "without ucm-db 1700.0 ms, with ucm-db 150.0 ms: 11.33x faster" in out
    assert "(2): 3000 -> 200 ms, 2800 -> 100 ms" in out
    assert "15.0x" in out and "28.0x" in out  # per-prompt speed-ups of the cold prompts


def test_an_unusable_store_stops_the_demo_before_any_engine(tmp_path: Path) -> None:
    not_a_store = tmp_path / "file"
    not_a_store.write_text("not a store")
    runner = CliRunner()
    result = runner.invoke(main, ["--store", str(not_a_store), "--seed", "1"], env={"UCM_DB_DEMO_DIR": str(tmp_path / "demo")})
    assert result.exit_code == 2
    assert f"cannot use the store at {not_a_store}" in result.output
    assert not (tmp_path / "demo" / "model").exists()  # stopped before building the model or starting vLLM


def test_demo_options_are_checked() -> None:
    assert "Example:" in CliRunner().invoke(main, ["--help"]).output
    assert CliRunner().invoke(main, ["--prompts", "1"]).exit_code == 2


def test_an_older_default_store_stops_the_demo_naming_the_migration(tmp_path: Path) -> None:
    """README: if the default store was written by an older ucm-db, the demo
    stops at once and names the fix (``ucm-db migrate``), changing nothing."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(Path(__file__).parent / "fixtures" / "stores" / "format2-lmdb", old)
    before = _records(old)
    assert len(before[b"blocks"]) == 11
    env = {"UCM_DB_PATH": str(old), "UCM_DB_DEMO_DIR": str(tmp_path / "demo")}
    result = CliRunner().invoke(main, ["--seed", "1"], env=env)
    assert result.exit_code == 2
    assert f"ucm-db migrate {old}" in result.output
    assert not (tmp_path / "demo" / "model").exists()
    after = _records(old)
    assert {table: after[table] for table in before} == before  # every record kept as it was


def _records(store: Path) -> dict[bytes, dict[bytes, bytes]]:
    """Every record of an LMDB store's tables, read with py-lmdb itself (read-only, no lock file)."""
    import lmdb

    env = lmdb.open(str(store / "lmdb"), readonly=True, lock=False, max_dbs=64, subdir=True)
    try:
        with env.begin() as txn:
            names = [key for key, _ in txn.cursor()]
        out = {}
        for name in names:
            with env.begin() as txn:
                out[name] = dict(txn.cursor(db=env.open_db(name, txn=txn)))
        return out
    finally:
        env.close()
