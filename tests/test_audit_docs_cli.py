"""docs/cli.md's and the README's promises about the ``ucm-db`` tool, held
through CliRunner on real LMDB stores:

* The README's command list is the tool's; docs/cli.md's table has a row
  for every command, and every flag its rows name is an option of that
  command; every benchmark the documents name exists.
* "A failed command prints one line with the fix on stderr; under
  ``--json`` stdout also holds the error as that one document", with the
  exit status the documents give (2: usage or configuration error), for
  each refusal they list; and read-only commands create nothing.
* The JSON fields the documents name are in the reports.
* ``unpin``'s report "says what stays" pinned once the whole file's pins
  are taken back (it once counted each prompt before the later prompts of
  the same file were unpinned).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

import ucm_db
from ucm_db.tools.cli import cli
from ucm_db.tools.cli_bench import bench_group
from ucm_db.tools.remote_cmds import parse_size_bytes

ROOT = Path(__file__).resolve().parents[1]
NS = ucm_db.Namespace(model="audit/cli", kv_dtype="bfloat16", block_size=16)
PROMPT = list(range(3000, 3000 + 16 * 5))  # 5 blocks
FORMAT1 = ROOT / "tests" / "fixtures" / "stores" / "format1-lmdb"


def invoke(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def make_store(path: Path) -> Path:
    with ucm_db.open(path, capacity_bytes=64 << 20) as store:
        keys = NS.block_keys(PROMPT)
        store.put(NS, keys, [bytes([i]) * 4096 for i in range(len(keys))])
    return path


def prompts_file(path: Path, *prompts: list[int]) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return path


def _options(command: Any) -> set[str]:
    return {o for p in command.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))}


def _documented_flags(name: str) -> set[str]:
    """The flags ``ucm-db NAME`` takes: its click options, or for a command
    that hands its arguments on (``proxy``) the ones its help lists."""
    options = _options(cli.commands[name])
    if options == {"args"}:
        options = set(re.findall(r"--[\w-]+", invoke(name, "--help").stdout))
    return options


# -- the command list and the table -----------------------------------------------------------------
def test_readme_and_cli_md_list_every_command_and_only_real_flags() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    listed = re.search(r"^`ucm-db ([a-z| ]+)` --", readme, flags=re.MULTILINE)
    assert listed and sorted(listed[1].split(" | ")) == sorted(cli.commands)
    table = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8").split("| command |", 1)[1].split("\n\n", 1)[0]
    rows = [cell.replace("\\|", "|") for cell in re.findall(r"^\| `(.+?)` \|", table, flags=re.MULTILINE)]
    seen, wrong = set(), {}
    for row in rows:
        for usage in row.split("` / `"):
            name = usage.split()[0]
            seen.add(name)
            flags = set(re.findall(r"--[\w-]+", usage)) - _documented_flags(name)
            if flags:
                wrong[name] = flags
    assert seen == set(cli.commands), f"commands without a row in docs/cli.md: {set(cli.commands) - seen}"
    assert not wrong, f"flags docs/cli.md names that the command lacks: {wrong}"


def test_the_commands_without_json_are_the_ones_the_docs_name() -> None:
    """docs/cli.md: every command prints "one JSON document with ``--json``"
    (but the ones it names); the README says the same."""
    lacking = {name for name in cli.commands if "--json" not in _options(cli.commands[name])}
    assert lacking == {"events", "proxy", "bench"}
    intro = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8").split("\n\n", 2)[1]
    exceptions = intro.split("with `--json` (but ", 1)[1].split(");", 1)[0]
    assert set(re.findall(r"`([a-z]+)`", exceptions)) == lacking
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "`--json` (but `events`, which streams JSON" in readme and "and `proxy`, a server" in readme


def test_every_benchmark_the_docs_name_exists() -> None:
    named: set[str] = set()
    for doc in ("README.md", "docs/api.md", "docs/cli.md", "docs/configuration.md"):
        text = (ROOT / doc).read_text(encoding="utf-8")
        named |= set(re.findall(r"ucm-db bench ([a-z][\w-]*)", text))
        for listing in re.findall(r"ucm-db bench ([a-z\-| ]+\|[a-z\-| ]+)", text):
            named |= {name.strip() for name in listing.split("|") if name.strip()}
    benchmarks = set(bench_group.list_commands(click.Context(bench_group)))
    assert named and named <= benchmarks, named - benchmarks
    assert "--trace" in _options(bench_group.get_command(click.Context(bench_group), "agentic"))  # README: `ucm-db bench agentic --trace FILE`


# -- refusals: one line with the fix, a JSON document, the documented exit status ------------------------
def _refusals(tmp: Path) -> list[tuple[list[Any], str]]:
    """(arguments, a fragment of the message) of refusals the documents list, each exit 2."""
    store, tokens = tmp / "s", tmp / "p.jsonl"
    (tmp / "nodata" / "lmdb").mkdir(parents=True)
    (tmp / "a_file").write_text("x")
    (tmp / "dir").mkdir()
    (tmp / "not.tar").write_text("hello")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "bad.jsonl").write_text("[1, 2]\n\n[1, -3]\n")
    (tmp / "dest").mkdir()
    (tmp / "dest" / "x").write_text("x")
    (tmp / "link").symlink_to(tmp / "dir")
    shutil.copytree(FORMAT1, tmp / "old")
    ns = ["--namespace", "audit/cli"]
    return [
        (["verify", tmp / "missing"], "no ucm-db store"),  # "no store at PATH"
        (["inspect", tmp / "a_file"], "is a file"),  # "a store path that is a file ... is reported"
        (["inspect", tmp / "nodata"], "no lmdb/data.mdb"),  # "an LMDB store without its data.mdb is reported"
        (["verify", tmp / "old"], "ucm-db migrate"),  # "a format that needs `ucm-db migrate`"
        (["inspect", store, "--namespace", " "], "is empty"),  # "an empty or whitespace --namespace"
        (["invalidate", store, "--namespace", ""], "is empty"),
        (["compact", store, "--target-bytes", "0.5"], "less than one byte"),  # "(0.5) is refused"
        (["compact", store, "--target-bytes", ""], "cannot read size"),  # "an empty ... never dropped"
        (["gc", "file:///nonexistent-audit", "--older-than", ""], "cannot read duration"),
        (["gc", "file:///nonexistent-audit", "--max-bytes", ""], "cannot read size"),
        (["gc", "file:///nonexistent-audit-root", "--older-than", "7d"], "does not exist"),  # "a gc file:// root that does not exist"
        (["gc", "", "--older-than", "7d"], "needs a remote URL"),  # "refuse a REMOTE that is not a URL"
        (["gc", ".", "--older-than", "7d"], "needs a remote URL"),
        (["gc", tmp / "dir", "--older-than", "7d"], "needs a remote URL"),
        (["events", store, "--poll-interval", "1"], "--follow"),  # "An option that does nothing without another"
        (["invalidate", store, *ns, "--option", "a=b"], "--remote"),  # "--option ... without --remote are exit 2"
        (["export", store, "-"], "standard output"),  # "writing to standard output (-) is not supported"
        (["export", store, store / "x.tar"], "inside the ucm-db store"),  # "refuses an archive path inside any store"
        (["export", store, tmp / "dir"], "not a regular file"),  # "not a regular file ... exit 2"
        (["import", tmp / "not.tar", store], "not a tar archive"),  # "an archive that is not a ucm-db export"
        (["pin", store, *ns, "--tokens", tmp / "empty.jsonl"], "holds no prompts"),  # "A tokens file with no prompt"
        (["pin", store, *ns, "--tokens", tmp / "bad.jsonl"], "line 3"),  # "naming the file and the line (blank lines counted)"
        (["pin", store, *ns, "--namespace", "audit", "--tokens", tokens], "one --namespace"),  # "a second one is refused"
        (["warm", tmp / "a_file", "--remote", "file:///x", *ns, "--tokens", tokens], "is a file"),  # "a PATH that is a file"
        (["migrate", "--to-engine", "rocksdb", store, store / "inner"], "inside the source store"),  # "a DEST inside PATH"
        (["migrate", "--to-engine", "rocksdb", store, tmp / "dest"], "not empty"),  # "a non-empty DEST"
        (["migrate", "--to-engine", "rocksdb", store, tmp / "link"], "is a symlink"),  # "a DEST that is a symlink"
    ]


def test_each_documented_refusal_is_one_line_with_the_fix_and_under_json_one_document(tmp_path: Path) -> None:
    make_store(tmp_path / "s")
    prompts_file(tmp_path / "p.jsonl", PROMPT)
    wrong = []
    for args, fragment in _refusals(tmp_path):
        human = invoke(*args)
        lines = human.stderr.strip().splitlines()
        if (human.exit_code, len(lines)) != (2, 1) or fragment not in lines[0] or "(hint: " not in lines[0]:
            wrong.append((args, human.exit_code, human.stderr))
            continue
        if "--json" in _options(cli.commands[str(args[0])]):
            document = json.loads(invoke(*args, "--json").stdout)
            error = document["error"]
            if set(error) != {"type", "message", "hint", "exit_code"} or error["exit_code"] != 2 or not error["hint"]:
                wrong.append((args, "json", document))
    assert not wrong, wrong
    # "Read-only commands never create anything"
    assert not (tmp_path / "missing").exists() and not (tmp_path / "nodata" / "lmdb" / "data.mdb").exists()
    assert not (tmp_path / "nonexistent-audit-root").exists()


def test_sizes_are_bytes_or_a_number_with_a_unit_read_exactly() -> None:
    said = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert "(integer arithmetic: `1.5KiB` is 1536; a fraction of a byte is dropped, `1.5` is 1)" in said
    read = {"500MB": 500_000_000, "10GiB": 10 << 30, "2TiB": 2 << 40, "4096": 4096, "1.5KiB": 1536, "1.5": 1,
            "9007199254740993": 9007199254740993}
    assert {text: parse_size_bytes(text) for text in read} == read


# -- JSON fields the documents name ---------------------------------------------------------------------
def test_the_json_fields_the_docs_name_are_in_the_reports(tmp_path: Path) -> None:
    store = make_store(tmp_path / "s")
    tokens = prompts_file(tmp_path / "p.jsonl", PROMPT)
    ns = ["--namespace", "audit/cli"]
    events = invoke("events", store)  # "puts through the Python API without event_fields= ... are never printed"
    assert (events.exit_code, events.stdout) == (0, "")
    found = json.loads(invoke("lookup", store, *ns, "--tokens", tokens, "--json").stdout)
    assert [(p["stored_blocks"], p["stored_tokens"]) for p in found["prompts"]] == [(5, 80)]
    assert invoke("pin", store, *ns, "--tokens", tokens).exit_code == 0
    inspected = json.loads(invoke("inspect", store, "--json").stdout)
    assert inspected["pinned_bytes"] > 0
    assert {"epoch", "pinned_bytes", "pinned_blocks"} <= set(inspected["namespaces"][0])
    assert "dropped_blocks" in json.loads(invoke("migrate", store, "--json").stdout)["pre_unit_blocks"]
    assert "left_out" in json.loads(invoke("export", store, tmp_path / "a.tar", "--json").stdout)
    assert "evicted" in json.loads(invoke("import", tmp_path / "a.tar", tmp_path / "t", "--json").stdout)
    remote = tmp_path / "remote"
    remote.mkdir()
    with ucm_db.open(tmp_path / "r", remote=f"file://{remote}") as shared:
        shared.put(NS, NS.block_keys(PROMPT), [b"x" * 1000] * 5)
        shared.flush()
    gc = json.loads(invoke("gc", f"file://{remote}", "--older-than", "7d", "--dry-run", "--json").stdout)
    assert {"held_by_rule", "held_namespaces", "held_reason", "landed_after_listing", "tombstones", "tombstones_removed",
            "skipped_entries", "bytes_after"} <= set(gc)
    claimed = json.loads(invoke("invalidate", tmp_path / "r", *ns, "--remote", f"file://{remote}", "--json").stdout)
    assert claimed["invalidated"][0]["remote"] == "claimed"


# -- unpin's report -------------------------------------------------------------------------------
def test_unpin_reports_what_stays_pinned_after_the_whole_file(tmp_path: Path) -> None:
    """docs/cli.md: "the report's ``pinned_blocks`` per prompt says what
    stays"; ucm_db.maintenance.pin: "per prompt its blocks ... pinned after
    the call". Unpinning every pinned prompt leaves nothing pinned."""
    store = make_store(tmp_path / "s")
    tokens = prompts_file(tmp_path / "p.jsonl", PROMPT, PROMPT[:32])  # a conversation and its 2-block system prompt
    ns = ["--namespace", "audit/cli"]
    assert invoke("pin", store, *ns, "--tokens", tokens).exit_code == 0
    result = invoke("unpin", store, *ns, "--tokens", tokens, "--json")
    assert json.loads(invoke("inspect", store, "--json").stdout)["pinned_bytes"] == 0  # holds today
    report = json.loads(result.stdout)
    assert [p["pinned_blocks"] for p in report["prompts"]] == [0, 0], report["prompts"]
    assert "stays pinned" not in result.stderr
