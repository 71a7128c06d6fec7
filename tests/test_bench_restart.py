"""The restart benchmark (tools/bench/restart.py): its sizes, its fill in the
engine's namespace, and its report and verdicts.

No engine starts here: ``ucm-db bench restart --quick`` starts three (seed,
without, with), about 2 minutes on a 2-core host, too long for the suite;
the fill is tested on a store seeded the way the connector seeds it (one
namespace whose layout names its KV heads and layers, one unit chain per
head).
"""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

import ucm_db
from ucm_db import BlockKeys, Namespace
from ucm_db.keys.units import KVGrid, UnitKeys
from ucm_db.tools.bench import restart
from ucm_db.tools.bench.restart import RestartOptions

LAYOUT = json.dumps({"platform": "cpu-vec-x86_64", "spec": "FullAttentionSpec", "layers": 3, "kv_heads": 2, "head_size": 64,
                     "cache_dtype": "auto"}, sort_keys=True, separators=(",", ":"))
NAMESPACE = Namespace(model="blake3:" + "ab" * 32, kv_dtype="float32", block_size=restart.BLOCK_SIZE, layout=LAYOUT)


def test_the_default_fill_is_a_million_blocks_or_a_share_of_the_free_disk() -> None:
    per_block = restart.block_disk_bytes(1024)
    assert per_block == 1024 + restart.INDEX_BYTES_PER_BLOCK
    assert restart.sized_blocks(10**12, 1024) == restart.MAX_BLOCKS
    assert restart.sized_blocks(10**9, 1024) == int(10**9 * restart.DISK_SHARE) // per_block
    assert restart.sized_blocks(10**9, 1024, share=0.5) == int(10**9 * 0.5) // per_block
    assert restart.sized_blocks(0, 1024) == 1000  # a full disk still measures a small store
    assert restart.capacity_bytes(10**6, 1024) > 10**6 * 1024  # the fill is never evicted


def test_max_model_len_holds_the_longest_prompt_and_its_token_in_whole_blocks() -> None:
    assert restart.max_model_len([2048, 8192]) == 8192 + restart.BLOCK_SIZE
    assert restart.max_model_len([256, 500]) == 512


def test_a_long_model_is_build_models_with_more_positions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Path] = []

    def fake_build(out_dir: Path, *, layers: int, hidden: int) -> Path:
        built.append(out_dir)
        if not (out_dir / "config.json").exists():
            out_dir.mkdir()
            (out_dir / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, "hidden_size": hidden}))
        return out_dir

    monkeypatch.setattr(restart, "build_model", fake_build)
    assert restart.model_dir(tmp_path, 2, 256, 4096) == tmp_path / "bench-model-2x256"  # shared with the other benchmarks
    long = restart.model_dir(tmp_path, 2, 256, 8224)
    assert long.name == f"bench-model-2x256-pos{restart.LONG_POSITIONS}"
    assert json.loads((long / "config.json").read_text()) == {"max_position_embeddings": restart.LONG_POSITIONS, "hidden_size": 256}
    assert restart.model_dir(tmp_path, 2, 256, 8224) == long and len(built) == 3  # a rerun reuses it


def test_prompts_are_seeded_and_none_starts_like_another() -> None:
    prompts = restart.make_prompts(3, [64, 96])
    assert [len(p) for p in prompts] == [64, 96] and prompts == restart.make_prompts(3, [64, 96])
    assert prompts[0][: restart.BLOCK_SIZE] != prompts[1][: restart.BLOCK_SIZE]
    assert all(3 <= t < restart.VOCAB for p in prompts for t in p)


def _seed_like_the_connector(path: Path) -> None:
    """One prompt's unit chains, as the seed engine leaves the store."""
    grid = KVGrid(2, 3)
    with ucm_db.open(path, codec="none") as store:
        keys = NAMESPACE.block_keys(list(range(3, 3 + 4 * restart.BLOCK_SIZE)), epoch=store.epoch(NAMESPACE))
        store.put_segments(NAMESPACE, [(BlockKeys(UnitKeys(keys, grid, span), parent=None), [b"x" * 16] * 4)
                                       for span in grid.head_spans()])


def test_the_fill_writes_the_engines_namespace_as_unit_chains(tmp_path: Path) -> None:
    path = tmp_path / "store"
    _seed_like_the_connector(path)
    filled = restart.fill_store(path, 1000, 32, seed=5)
    per_chain = restart.CHAIN_BLOCKS * 2
    assert filled["seeded_blocks"] == 8 and filled["kv_heads"] == 2 and filled["namespace"] == NAMESPACE.short_id
    assert filled["blocks"] == 8 + -(-(1000 - 8) // per_chain) * per_chain and filled["filled_blocks"] == filled["blocks"] - 8
    assert filled["file_bytes"] > 0 and filled["blocks_per_s"] > 0
    with ucm_db.open(path) as store:
        assert list(store.stats().namespaces) == [NAMESPACE.id.hex()]  # no namespace of its own
        # The first filled chain, as fill_store drew it: every head's units are found under the connector's keys.
        rng = random.Random(5 + 1)
        tokens = [rng.randrange(3, restart.VOCAB) for _ in range(restart.CHAIN_BLOCKS * restart.BLOCK_SIZE)]
        keys = NAMESPACE.block_keys(tokens, epoch=store.epoch(NAMESPACE))
        grid = KVGrid(2, 3)
        assert [store.lookup(NAMESPACE, UnitKeys(keys, grid, span)) for span in grid.head_spans()] == [restart.CHAIN_BLOCKS] * 2
    assert len(restart.time_opens(path, 2)) == 2
    assert restart.fill_store(path, 100, 32, seed=5)["filled_blocks"] == 0  # already that large: nothing more


def test_a_store_of_several_namespaces_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store"
    _seed_like_the_connector(path)
    other = Namespace(model="other", kv_dtype="float32", block_size=restart.BLOCK_SIZE, layout=LAYOUT)
    with ucm_db.open(path) as store:
        store.put(other, other.block_keys(list(range(restart.BLOCK_SIZE))), [b"y"])
    with pytest.raises(SystemExit, match="holds 2 namespaces"):
        restart.fill_store(path, 1000, 32, seed=1)


def _engine(init_s: float, ttfts: list[float], warm: list[float], cached: list[int], token: int = 7) -> dict:
    def requests(times: list[float], hits: list[int]) -> list[dict]:
        return [{"ttft_s": t, "cached": c, "first_token": token} for t, c in zip(times, hits)]
    return {"init_s": init_s, "ready_s": init_s + 10, "import_s": 5.0, "warmup_ttft_s": 0.05, "init_started_at": 90.0,
            "passes": {"first": requests(ttfts, cached), "warm": requests(warm, [c or 2016 for c in cached])}}


def _raw() -> dict:
    with_steps = [{"pid": 1, "step": "init", "role": "scheduler", "s": 1.5, "end": 105.0},
                  {"pid": 2, "step": "init", "role": "worker", "s": 1.0, "end": 100.0},
                  {"pid": 2, "step": "import", "role": "", "s": 0.2, "end": 99.0}, {"pid": 1, "step": "import", "role": "", "s": 0.2, "end": 99.1}]
    ucm = [_engine(31.0, [0.2, 0.5], [0.05, 0.1], [2016, 8160]), _engine(33.0, [0.3, 0.7], [0.05, 0.1], [2016, 8160])]
    for engine in ucm:
        engine.update(connector_steps=with_steps, fingerprint_s=[0.01, 0.01])
    cold = [_engine(30.0, [2.0, 9.0], [0.05, 0.1], [0, 0]), _engine(31.0, [2.2, 9.4], [0.05, 0.1], [0, 0])]
    seed = _engine(35.0, [2.5, 9.9], [], [0, 0])
    fill = {"namespace": "ab", "kv_heads": 4, "seeded_blocks": 1280, "blocks": 1_000_192, "filled_blocks": 998_912, "fill_bytes": 1024,
            "fill_s": 86.0, "blocks_per_s": 11615.0, "file_bytes": 3_374_985_216, "stored_bytes": 1_100_000_000}
    return {"seed": seed, "fill": fill, "open_s": [1.2, 1.3, 1.25], "engines": {"without": cold, "with": ucm},
            "blocks_after": 1_000_200, "free_disk_bytes": 6 * 10**10}


def test_the_report_takes_medians_ratios_and_honest_verdicts() -> None:
    report = restart.summarise(_raw(), RestartOptions(blocks=1_000_192), "float32")
    assert report["init_median_s"] == {"without": 30.5, "with": 32.0}
    assert report["start_added_s"] == pytest.approx(1.5)
    assert report["open_median_s"] == 1.25 and report["store"]["engine_blocks"] == 250_048
    two_k, eight_k = report["ttft"]
    assert two_k["tokens"] == 2048 and two_k["ratio"] == pytest.approx(2.1 / 0.25) and two_k["ucmdb_hit_tokens"] == 2016
    assert eight_k["ratio"] == pytest.approx(9.2 / 0.6) and eight_k["seed_ms"] == pytest.approx(9900)
    assert eight_k["cold_runs_ms"] == [9000.0, 9400.0] and eight_k["same_first_token"] is True
    # An engine's steps are summed over its processes, then the median over engines.
    assert report["connector_start_s"] == {"fingerprint": pytest.approx(0.02), "import": pytest.approx(0.4),
                                           "init (scheduler)": 1.5, "init (worker)": 1.0}
    assert report["connector_busy_s"] == pytest.approx(1.2 + 1.5)  # imports and the worker's init: 98.8 to 100.0 s
    assert report["init_spread_s"] == {"without": 1.0, "with": 2.0}
    assert report["connector_timelines"][0] == [["import", "", 2, 8.8, 0.2], ["import", "", 1, 8.9, 0.2],
                                                ["init", "worker", 2, 9.0, 1.0], ["init", "scheduler", 1, 13.5, 1.5]]
    targets = report["targets"]
    # Judged by the connector's own steps (2.7 s), not by the 1.5 s difference of noisy engine starts.
    assert targets["start_added_s"]["value"] == pytest.approx(2.7) and targets["start_added_s"]["met"] is False
    assert targets["ratio_at_longest"]["met"] is True
    assert "8192 tokens" in targets["ratio_at_longest"]["target"]
    table = restart.format_table(report)
    assert "without (medians): +1.50 s" in table and "wall time with one running: 2.70 s" in table
    assert "2.70 s (MISSED)" in table and "15.3x (met)" in table
    json.dumps(report)  # --json prints it


def test_busy_time_counts_overlapping_steps_once() -> None:
    def step(start: float, end: float) -> dict:
        return {"s": end - start, "end": end}
    assert restart.busy_seconds([]) == 0.0
    assert restart.busy_seconds([step(0, 2), step(1, 3), step(5, 6)]) == pytest.approx(4.0)
    assert restart.busy_seconds([step(0, 10), step(2, 3)]) == pytest.approx(10.0)  # one inside another


def test_the_bench_and_its_connector_name_the_same_class_and_variable() -> None:
    # The bench never imports restart_connector (it imports vLLM): read its source.
    source = (Path(restart.__file__).parent / "restart_connector.py").read_text()
    tree = ast.parse(source)
    assert restart.CONNECTOR_MODULE == "ucm_db.tools.bench.restart_connector"
    assert restart.CONNECTOR_NAME in {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assigned = {node.targets[0].id: node.value.value for node in tree.body
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.targets[0], ast.Name)}
    assert assigned["TIMINGS_ENV"] == restart.TIMINGS_ENV


def test_differing_first_tokens_are_reported() -> None:
    raw = _raw()
    raw["engines"]["with"][0]["passes"]["first"][1]["first_token"] = 8
    rows = restart.summarise(raw, RestartOptions(), "float32")["ttft"]
    assert rows[0]["same_first_token"] is True and rows[1]["same_first_token"] is False


@pytest.mark.parametrize(("args", "message"), [
    (["--tokens", "2048,2048"], "distinct prompt lengths"),
    (["--tokens", "16"], "distinct prompt lengths"),
    (["--tokens", "a,b"], "distinct prompt lengths"),
    (["--hidden", "300"], "multiple of 64"),
])
def test_bad_options_are_usage_errors_before_any_engine_starts(args: list[str], message: str) -> None:
    result = CliRunner().invoke(restart.command, args)
    assert result.exit_code == 2 and message in result.output


def test_quick_presets_fill_in_only_what_was_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[RestartOptions] = []
    def fake_run(options: RestartOptions) -> dict:
        seen.append(options)
        return {}

    monkeypatch.setattr(restart, "run", fake_run)
    monkeypatch.setattr(restart, "format_table", lambda report: "table")
    assert CliRunner().invoke(restart.command, ["--quick", "--starts", "3"]).exit_code == 0
    assert CliRunner().invoke(restart.command, ["--tokens", "4096,1024"]).exit_code == 0
    quick, default = seen
    assert quick.starts == 3 and quick.blocks == restart.QUICK["blocks"] and quick.eager is True
    assert default.tokens == (1024, 4096) and default.blocks is None and default.layers == 4 and default.eager is False
