"""README.md's claims that no other test held (tests/test_audit_docs*.py and
tests/test_store_option_promises.py hold links, names, the Python snippet,
the table's defaults and ranges, the command list). Real LMDB stores in
``tmp_path``; no vLLM engine is started. Invariants held here:

* The demo's sample is, line for line, what ``print_headline`` prints for
  timings within its rounding; the demo's defaults and block size are the
  workload and hits the README gives; a flip within 0.05 nats passes.
* Every figure the README quotes is its source's, and its ratios add up.
* Exactly the five options named are recorded at creation; an unknown option
  lists every valid one, connector keys are refused by ``ucm_db.open``; a
  JSON config file holds store options; a reader slot costs 64 bytes.
* Without the C extension ucm-db runs and stores the extension's bytes.
* ``dev.py`` hands extra arguments to the job; ``--long`` and ``-m "not
  vllm"`` select as said; the vLLM facts the connector section relies on;
  pyproject; the flags named; every "Where to read more" topic has a section.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import inspect
import io
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import click
import numpy as np
import pytest

import ucm_db
from ucm_db import ConfigError
from ucm_db.config import PERSISTED_FIELDS, StoreConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SEEDS = [0, 1, 2026]


def _flat(text: str) -> str:  # a phrase wrapped across lines still matches
    return " ".join(text.split())


def _table_rows() -> dict[str, str]:
    """``option -> its whole row`` of the README's configuration table."""
    table = README[README.index("| option | default |"):].split("\n\n", 1)[0]
    return dict(re.findall(r"^\| `(\w+)` \|(.*)$", table, flags=re.MULTILINE))


# -- the demo ----------------------------------------------------------------------------------------
def _sample() -> str:
    return README.split("What it printed", 1)[1].split("```\n", 1)[1].split("```", 1)[0]


def _sample_rows() -> list[list[str]]:
    return [line.split() for line in _sample().splitlines() if re.match(r"\s+\d+\s+\d+\s", line)]


def _unrounded(without_ms: float, with_ms: float, speed_up: str) -> tuple[float, float]:
    """Timings that print as the sample's two TTFT cells and its speed-up cell."""
    steps = sorted((d / 100 for d in range(-4, 5)), key=abs)
    for dw in steps:
        for du in steps:
            if f"{(without_ms + dw) / (with_ms + du):.1f}x" == speed_up:
                return without_ms + dw, with_ms + du
    raise AssertionError(f"no timings within rounding of {without_ms} / {with_ms} give {speed_up}")


def test_the_readme_demo_sample_is_what_the_demo_prints_for_those_timings() -> None:
    from ucm_db.tools.demo import compare_first_tokens, print_headline, run_demo

    rows = _sample_rows()
    timings = [_unrounded(float(r[3]), float(r[6]), r[7]) for r in rows]
    without = {"ttft_s": [w / 1e3 for w, _ in timings], "cached": [int(r[2]) for r in rows]}
    with_ucm = {"ttft_s": [u / 1e3 for _, u in timings], "cached": [int(r[4]) for r in rows],
                "ucm_hits": [(int(r[4]), int(r[5])) for r in rows]}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_headline([[1] * int(r[1]) for r in rows], with_ucm, without)  # six rows: a row lost fails below
    same = {"first_tokens": [7] * 6, "top_logprobs": [{"7": -1.0}] * 6}
    verdicts = ", ".join(compare_first_tokens(same, same))
    line = "first token, pass 2 (ucm-db after restart) vs pass 1, per prompt: "
    assert line + "{', '.join(verdicts)}" in inspect.getsource(run_demo)
    assert out.getvalue().lstrip("\n") + line + verdicts + "\n" == _sample()


def test_the_demo_runs_the_workload_the_readme_describes() -> None:
    from ucm_db.tools import demo
    from ucm_db.tools.bench import engine_pass

    said = _flat(README)
    assert "runs a random-weight 6-layer Llama on six 1664-token prompts in two groups sharing 1536-token" in said
    defaults = {param.name: param.default for param in demo.main.params}
    assert (defaults["count"], defaults["prefix_tokens"], defaults["suffix_tokens"]) == (6, 1536, 128)
    for seed in SEEDS:
        prompts = demo.make_prompts(seed, 6, 1536, 128)
        assert [len(p) for p in prompts] == [1664] * 6
        assert prompts[0][:1536] != prompts[1][:1536]
        assert all(p[:1536] == prompts[i % 2][:1536] and p[1536:] != prompts[i % 2][1536:]
                   for i, p in enumerate(prompts) if i >= 2)  # "Prompts 2-5 share their first 1536 tokens"
    # The sample's hits: all but the last block (always computed), and the tail past vLLM's own 1536.
    whole = (1664 // demo.BLOCK_SIZE - 1) * demo.BLOCK_SIZE
    assert [(int(r[4]), int(r[5])) for r in _sample_rows()] == [(0, whole)] * 2 + [(1536, whole - 1536)] * 4
    assert f"ucm-db adds only their stored tails (96 tokens, in blocks of {demo.BLOCK_SIZE}; the last block is always computed)" in said
    assert inspect.signature(engine_pass.build_model).parameters["layers"].default == 6
    assert "build_model(demo_dir() / \"model\")" in inspect.getsource(demo.run_demo)
    assert demo.RESERVED_CPUS == 1 and "(`VLLM_CPU_NUM_OF_RESERVED_CPU=1`" in said
    assert '"reserved_cpus": RESERVED_CPUS' in inspect.getsource(demo.run_demo)
    dtype = next(p for p in demo.main.params if p.name == "dtype")
    assert isinstance(dtype.type, click.Choice) and {"bfloat16", "float32"} <= set(dtype.type.choices)


@pytest.mark.parametrize(("gap", "verdict", "status"), [(0.04, "near-tie", 0), (0.05, "near-tie", 0),
                                                        (0.06, "DIFFERENT", 1)])
def test_a_flip_within_0_05_nats_passes_and_one_beyond_fails_the_demo(gap: float, verdict: str, status: int) -> None:
    from ucm_db.tools.demo import NEAR_TIE_LOGPROB, compare_first_tokens, exit_status

    assert NEAR_TIE_LOGPROB == 0.05 and "within 0.05 nats of each other is reported as a `near-tie`" in _flat(README)
    first = {"first_tokens": [7], "top_logprobs": [{"7": -2.0, "9": -2.0 - gap}]}
    second = {"first_tokens": [9], "top_logprobs": [{"9": -2.0, "7": -2.001}]}
    verdicts = compare_first_tokens(first, second)
    assert verdicts[0].startswith(verdict) and exit_status(verdicts) == status


# -- figures -----------------------------------------------------------------------------------------
#: (what the README says, the document that holds the figure, what that document says).
QUOTED = [
    ("`zstd` holds 1.47x more blocks in the same bytes", "BENCHMARKS.md", "| zstd ratio on real bf16 K/V | 1.471"),
    ("it took 4 min 30 s from a fresh clone", "BENCHMARKS.md", "**4 min 30 s**, median TTFT **2.83x** (108.7 -> 38.4"),
    ("the median 108.7 -> 38.4 ms (2.83x)", "BENCHMARKS.md", "cold prompts 21-23x"),
    ("the whole demo took 7 min 15 s after set-up", "BENCHMARKS.md", "7 min 15 s after set-up, 3.32x"),
    ("without ucm-db 109.7 ms, with ucm-db 40.8 ms: 2.69x faster", "BENCHMARKS.md",
     "30ed9b5 2.69x (109.7 vs 40.8 ms), cold 19-21x"),
    ("all the ideal hits against 0.84 with `false`, for 1.11x the bytes", "BENCHMARKS.md",
     "true serves **1.00** of the ideal hits (30,208 tokens) against 0.84, for **1.11x** the bytes"),
    ("(`true` stores 2.28x the bytes there for no hit", "BENCHMARKS.md", "true stores **2.28x**"),
    ("1.04-1.11x the req/s of in-worker commits", "BENCHMARKS.md", "**1.04x** (growing store) and **1.11x**"),
    ("(about 0.2-2.4 s per 100k blocks)", "docs/configuration.md", "0.2-0.9 s warm, 1.6-2.4 s cold per 100k blocks"),
    ("a 2048-token prefill took 28.0 s in bfloat16 and 6.2 s in float32", "tools/bench/cpu_dtype.py",
     "one 2048-token prefill of the 8-layer serving model took 28.0 s in bfloat16 against 6.2 s in float32"),
    ("(a 16-core H200 host read 256 KiB units 2.4x faster over 4 than over 1)", "connector/worker/split_reads.py",
     "256 KiB 1.62x, 2.39x"),
]


@pytest.mark.parametrize(("said", "source", "there"), QUOTED, ids=[q[1] + ":" + q[0][:24] for q in QUOTED])
def test_each_figure_the_readme_quotes_is_its_sources(said: str, source: str, there: str) -> None:
    assert said in _flat(README), "the README no longer says this: update QUOTED"
    assert there in _flat((ROOT / source).read_text()), f"{source} no longer holds the README's figure"


def test_the_readme_figures_add_up_and_name_the_code_constants() -> None:
    from ucm_db.committer import REPLY_TIMEOUT_S

    said = _flat(README)
    ratios = {"311.5 -> 93.7 ms (3.32x)": 311.5 / 93.7, "108.7 -> 38.4 ms (2.83x)": 108.7 / 38.4}
    assert all(phrase in said and phrase.endswith(f"({ratio:.2f}x)") for phrase, ratio in ratios.items())
    cold = re.search(r"(\d+) -> (\d+) ms and (\d+) -> (\d+) ms, the median 108\.7", said)
    assert cold, "the AVX-512 host's cold prompts moved"
    assert all(21 <= int(cold[i]) / int(cold[i + 1]) < 23.5 for i in (1, 3))  # BENCHMARKS.md: "cold prompts 21-23x"
    assert "answers nothing for 300 s, saves commit in the worker again" in said and REPLY_TIMEOUT_S == 300


# -- store options -----------------------------------------------------------------------------------
def test_exactly_the_five_readme_options_are_recorded_at_creation(tmp_path: Path) -> None:
    from ucm_db import maintenance

    recorded = re.search(r"\. ((?:`\w+`(?:, | and ))+`\w+`) are recorded when a store is created", _flat(README))
    assert recorded and set(re.findall(r"`(\w+)`", recorded[1])) == set(PERSISTED_FIELDS)
    unpersisted = {name for name, row in _table_rows().items() if re.search(r"(not|never) persisted", row)}
    assert unpersisted >= {"max_pinned_bytes", "remote_options"} and not unpersisted & set(PERSISTED_FIELDS)
    (tmp_path / "remote").mkdir()
    created = {"capacity_bytes": 64 << 20, "codec": "none", "zstd_level": 3, "durability": "sync", "engine": "lmdb"}
    others = {"remote": f"file://{tmp_path / 'remote'}", "remote_options": {"auto_mkdir": True}, "max_pinned_bytes": 0,
              "sync_interval_s": 2.0, "encode_threads": 0, "max_readers": 64, "check_on_open": "none"}
    ucm_db.open(tmp_path / "s", **created, **others).close()
    assert maintenance.inspect(tmp_path / "s")["settings"] == created
    with ucm_db.open(tmp_path / "s") as store:  # "reopening with no options uses them"
        config = store.config
    assert {name: getattr(config, name) for name in created} == created
    assert (config.max_pinned_bytes, config.remote_options, config.remote) == (None, {}, None)


def test_unknown_options_list_every_valid_one_and_store_options_come_from_json_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown option") as info:
        ucm_db.open(tmp_path / "s", capcity_bytes=1)
    valid = info.value.hint.split("valid options are: ", 1)[1]
    assert set(valid.split(", ")) == {field.name for field in dataclasses.fields(StoreConfig)}
    rows = list(_table_rows())
    assert len(connector_keys := rows[rows.index("path") + 1:]) >= 14  # the rows under "connector keys"
    for key in connector_keys:
        with pytest.raises(ConfigError, match=key):
            ucm_db.open(tmp_path / "s", **{key: "auto"})
    assert not (tmp_path / "s").exists()
    # "Store options go to ... or into a YAML or JSON config file"
    options = {"codec": "none", "capacity_bytes": 64 << 20, "durability": "sync", "zstd_level": 4}
    (tmp_path / "ucm.json").write_text(json.dumps(options))
    with ucm_db.open(tmp_path / "s", **ucm_db.load_config_file(tmp_path / "ucm.json")) as store:
        assert {name: getattr(store.config, name) for name in options} == options


def test_each_lmdb_reader_slot_costs_64_bytes_of_lock_file(tmp_path: Path) -> None:
    assert "concurrent readers against 64 bytes of lock file each" in _table_rows()["max_readers"]
    sizes = {}
    for readers in (8, 1032):
        with ucm_db.open(tmp_path / str(readers), max_readers=readers, capacity_bytes=64 << 20):
            sizes[readers] = (tmp_path / str(readers) / "lmdb" / "lock.mdb").stat().st_size
    assert sizes[1032] - sizes[8] == 64 * 1024


# -- the C extension and its fallback ----------------------------------------------------------------
FALLBACK_PROBE = """
import json, sys; sys.modules["ucm_db._native"] = None  # as if never built: no compiler or headers at install
import ucm_db
from ucm_db.codec import native
from ucm_db.maintenance import iter_blocks
ns = ucm_db.Namespace(**json.loads(sys.argv[1]))
payloads = [bytes.fromhex(h) for h in json.loads(sys.argv[2])]
keys = ns.block_keys(list(range(16 * len(payloads))))
with ucm_db.open(sys.argv[3], codec="zstd", capacity_bytes=64 << 20) as store:
    store.put(ns, keys, payloads)
with ucm_db.open(sys.argv[4]) as store:
    read = [bytes(b).hex() for b in store.get(ns, keys)]
print(json.dumps({"native": native.NATIVE_AVAILABLE, "read": read,
                  "stored": {b.key.hex(): b.stored_bytes for b in iter_blocks(sys.argv[3])}}))
"""


def _bf16_payloads(seed: int, count: int = 6, size: int = 8192) -> list[bytes]:  # smooth: zstd's planes matter
    rng = np.random.default_rng(seed)
    walks = [np.cumsum(rng.standard_normal(size // 2)).astype(np.float32) for _ in range(count)]
    return [(walk.view(np.uint32) >> 16).astype(np.uint16).tobytes() for walk in walks]


def test_without_the_extension_ucm_db_runs_and_stores_the_extensions_bytes(tmp_path: Path) -> None:
    from ucm_db.codec.native import NATIVE_AVAILABLE
    from ucm_db.maintenance import iter_blocks

    assert NATIVE_AVAILABLE, "tests/test_native.py says why the extension is missing"
    fields: dict[str, Any] = {"model": "readme/fallback", "kv_dtype": "bfloat16", "block_size": 16}
    ns, payloads = ucm_db.Namespace(**fields), _bf16_payloads(SEEDS[2])
    keys = ns.block_keys(list(range(16 * len(payloads))))
    with ucm_db.open(tmp_path / "native", codec="zstd", capacity_bytes=64 << 20) as store:
        store.put(ns, keys, payloads)
    args = [json.dumps(fields), json.dumps([p.hex() for p in payloads]), str(tmp_path / "fallback"),
            str(tmp_path / "native")]
    done = subprocess.run([sys.executable, "-c", FALLBACK_PROBE, *args], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    probe = json.loads(done.stdout)
    assert probe["native"] is False
    assert [bytes.fromhex(h) for h in probe["read"]] == payloads  # the fallback reads the extension's store
    assert probe["stored"] == {b.key.hex(): b.stored_bytes for b in iter_blocks(tmp_path / "native")}
    with ucm_db.open(tmp_path / "fallback") as store:  # and the extension reads the fallback's
        assert [bytes(b) for b in store.get(ns, keys)] == payloads  # type: ignore[arg-type]
        slab = bytearray(sum(map(len, payloads)))
        assert store.get_into(ns, keys, ucm_db.ScatterSlabs([memoryview(slab)], [8192], range(6))) == [True] * 6
        assert bytes(slab) == b"".join(payloads)


def test_the_extension_is_optional_and_built_from_the_c_sources_under_ucm_db() -> None:
    calls = [node for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Extension"]
    assert len(calls) == 1
    args = {kw.arg: kw.value for kw in calls[0].keywords}
    assert ast.literal_eval(calls[0].args[0]) == "ucm_db._native" and ast.literal_eval(args["optional"]) is True
    c_sources = {path.relative_to(ROOT).as_posix() for path in ROOT.glob("ucm_db/**/*.c")}
    assert set(ast.literal_eval(args["sources"])) == c_sources


# -- dev.py and the test command ------------------------------------------------------------------------
def test_dev_py_hands_extra_arguments_to_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recorded, not run: the real jobs set up 3.5 GB and start engines."""
    spec = importlib.util.spec_from_file_location("dev_under_review", ROOT / "dev.py")
    assert spec is not None and spec.loader is not None
    dev: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    ran: list[tuple[list[str], Any]] = []
    monkeypatch.setattr(dev, "ensure_venv", lambda: None)
    monkeypatch.setattr(dev, "ensure_fuse3", lambda: None)
    def call(cmd: list[str], cwd: Path, env: dict[str, str]) -> int:
        ran.append((cmd, cwd))
        return 0

    class Started:  # the background part (dev.run_in_two_parts), recorded, not run
        def __init__(self, cmd: list[str], cwd: Path, **_: Any) -> None:
            ran.append((cmd, cwd))

        def wait(self) -> int:
            return 0

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(dev.subprocess, "call", call)
    monkeypatch.setattr(dev.subprocess, "Popen", Started)
    for args in (["test", "-m", "not vllm"], ["test", "--long"], ["test", "--long", "--two-parts"],
                 ["demo", "--dtype", "float32"]):
        assert dev.main(["dev.py", *args]) == 0
    pytest_cmd = [str(ROOT / ".venv" / "bin" / "python"), "-m", "pytest"]
    assert ran == [([*pytest_cmd, "-m", "not vllm"], ROOT), ([*pytest_cmd, "--long"], ROOT),
                   ([*pytest_cmd, "--long", "-o", "cache_dir=.pytest_cache/part-1", "--part", "1"], ROOT),
                   ([*pytest_cmd, "--long", "--part", "2"], ROOT),
                   ([pytest_cmd[0], "-m", "ucm_db.tools.demo", "--dtype", "float32"], ROOT)]


MARKED = "import pytest\ndef test_core(): pass\n@pytest.mark.long\ndef test_soak(): pass\n" \
         "@pytest.mark.vllm\ndef test_engine(): pass\n"


@pytest.mark.parametrize(("args", "kept"), [([], {"test_core", "test_engine"}),
                                            (["--long"], {"test_core", "test_soak", "test_engine"}),
                                            (["-m", "not vllm"], {"test_core"})])
def test_long_adds_the_long_tests_and_not_vllm_drops_the_engine_tests(tmp_path: Path, args: list[str],
                                                                      kept: set[str]) -> None:
    shutil.copyfile(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_marked.py").write_text(MARKED)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers\nmarkers =\n    long: l\n    vllm: v\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--collect-only", *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert set(re.findall(r"::(\w+)$", done.stdout, flags=re.MULTILINE)) == kept


# -- vLLM, packaging, flags and further reading ---------------------------------------------------------
def test_the_vllm_facts_the_connector_section_relies_on() -> None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    vllm = Path(spec.submodule_search_locations[0])
    names = {d.metadata["Name"].lower().replace("_", "-") for d in importlib.metadata.distributions()}
    if "vllm-cpu" in names:  # "With `vllm-cpu`, whose `vllm` script fails to find its own distribution"
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version("vllm")
        assert 'importlib.metadata.version("vllm")' in (vllm / "entrypoints" / "cli" / "main.py").read_text()
    assert 'if __name__ == "__main__":' in (vllm / "entrypoints" / "openai" / "api_server.py").read_text()
    assert any("enable_prompt_tokens_details: bool" in p.read_text(encoding="utf-8")
               for p in (vllm / "entrypoints").rglob("cli_args.py"))
    llm_source = (vllm / "entrypoints" / "llm.py").read_text(encoding="utf-8")
    reset = next(node for node in ast.walk(ast.parse(llm_source))
                 if isinstance(node, ast.FunctionDef) and node.name == "reset_prefix_cache")
    assert "reset_connector" in {arg.arg for arg in reset.args.args}  # LLM.reset_prefix_cache(reset_connector=True)
    assert re.search(r'isinstance\(\s*kwargs\["kv_transfer_config"\], dict', llm_source)  # "pass the same dict"


def test_pyproject_dev_py_and_the_flags_are_what_the_readme_says() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == ">=3.11"
    extras = project["project"]["optional-dependencies"]
    assert "ascend" in extras and any(dep.startswith("cryptography") for dep in extras["remote"])
    assert any(dep.startswith("rocksdict") for dep in extras["rocksdb"])  # "RocksDB (`rocksdict`)"
    assert project["project"]["scripts"] == {"ucm-db": "ucm_db.tools.cli:main"}
    dirs = project["tool"]["setuptools"]["package-dir"]
    assert (dirs["ucm_db.tools"], dirs["ucm_db.connector"]) == ("tools", "connector")  # ucm_db.tools.demo
    assert (ROOT / "tools" / "demo.py").is_file()
    warming = ast.parse((ROOT / "connector" / "warming.py").read_text())
    assert "warm_engine" in {node.name for node in warming.body if isinstance(node, ast.FunctionDef)}
    tree = ast.parse((ROOT / "dev.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names)  # "Both commands need only Python 3.11"
    from ucm_db.tools.cli import cli  # the flags the README names are options of their commands

    named = {"verify": "--fix", "invalidate": "--namespace", "export": "--encryption-key-file",
             "import": "--encryption-key-file"}
    assert all(flag in README for flag in named.values())
    assert all(flag in {o for p in cli.commands[cmd].params for o in getattr(p, "opts", ())}
               for cmd, flag in named.items())


#: README "Where to read more": document -> the topics it promises, each a heading there.
FURTHER = {
    "docs/connector.md": ["Settings", "When it cannot start", "Stopping", "Hybrid models", "Metrics",
                          "Reset and invalidation", "Preemption", "MultiConnector", "vllm-ascend"],
    "docs/configuration.md": ["Environment variables"], "docs/remote.md": ["Cache warming"],
    "docs/api.md": ["Payloads, frames and scatter lists", "Loads into the KV cache", "Errors"],
    "docs/storage.md": ["Design", "Durability, precisely", "Large stores", "LMDB versions"],
    "docs/tp.md": ["Pipeline parallelism"], "docs/cli.md": ["Store formats and migrations", "RocksDB engine"],
    "docs/architecture.md": ["The layers", "What each folder may import"],
}


def test_each_topic_where_to_read_more_promises_has_its_section() -> None:
    missing = {doc: [t for t in topics if not re.search(rf"^#+ .*{re.escape(t)}", (ROOT / doc).read_text(), re.M)]
               for doc, topics in FURTHER.items()}
    assert not {doc: topics for doc, topics in missing.items() if topics}
    configuration = (ROOT / "docs" / "configuration.md").read_text()  # "Ranges and details of each"
    entries = {name for line in re.findall(r"^\* `.*$", configuration, flags=re.MULTILINE)
               for name in re.findall(r"`(\w+)`", line.split("(default", 1)[0])}
    rows = list(_table_rows())
    assert set(rows[:rows.index("path")]) - entries == set()


def test_a_python_api_namespace_keys_its_tp_fields_so_only_the_defaults_share_a_store() -> None:
    """The snippet's ``tp_rank=0, tp_size=1`` are the defaults the connector keeps (a key "never" covers the TP
    size or rank there); a Python API user passing a real rank gets keys of their own (docs/storage.md)."""
    base = ucm_db.Namespace(model="readme/tp", kv_dtype="bfloat16", block_size=16)
    ranked = dataclasses.replace(base, tp_rank=1, tp_size=2)
    assert base.block_keys(list(range(64)))[0] != ranked.block_keys(list(range(64)))[0]
    said = _flat((ROOT / "docs" / "storage.md").read_text())
    assert "code of your own sharing a store across ranks must do the same" in said
