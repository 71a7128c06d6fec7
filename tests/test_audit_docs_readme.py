"""The user-facing documents' promises about themselves and the Python API,
read as a new user reads them (README.md, docs/api.md, docs/cli.md,
docs/configuration.md):

* README.md stays at most 300 lines and opens with its two commands.
* Every link (file and anchor) and every repository path the four
  documents name exists, and so does every public name they tell a user
  to import or call.
* The Python API snippets of README.md and docs/api.md run as written on
  a real LMDB store and do what their comments say.
* The connector rows of the README's configuration table hold the
  connector's defaults, and the values they name are taken.

The store options' rows are held by tests/test_store_option_promises.py.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
from pathlib import Path
from typing import Any

import pytest

import ucm_db

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
USER_DOCS = ("README.md", "docs/api.md", "docs/cli.md", "docs/configuration.md")
OPENING = (
    "```bash\n"
    "python3 dev.py demo   # set-up (.venv with ucm-db + vLLM CPU) and the main job: a vLLM engine on CPU restarted "
    "with ucm-db against one restarted without it, same prompts, TTFT per prompt\n"
    "python3 dev.py test   # set-up and the whole test suite (core, CLI, remote on a local S3 endpoint, crash loops, "
    "real vLLM engines)\n"
    "```\n"
)


def _text(doc: str) -> str:
    return (ROOT / doc).read_text(encoding="utf-8")


# -- README's shape -------------------------------------------------------------------------
def test_readme_stays_at_most_300_lines_and_opens_with_its_two_commands() -> None:
    text = _text("README.md")
    assert len(text.splitlines()) <= 300
    assert text.startswith("# ucm-db\n\n" + OPENING)


# -- links, paths and names -------------------------------------------------------------------
def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(h) for h in re.findall(r"^#+ (.*)$", path.read_text(encoding="utf-8"), flags=re.MULTILINE)}


@pytest.mark.parametrize("doc", USER_DOCS)
def test_every_link_and_repository_path_a_user_doc_names_exists(doc: str) -> None:
    page = ROOT / doc
    text = _text(doc)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        linked = (page.parent / file) if file else page
        if not linked.exists() or (anchor and anchor not in _anchors(linked)):
            broken.append(target)
    for path in re.findall(r"`((?:ucm_db|tests|tools|migrations|connector)/[\w/.\-]+)`", text):
        pattern = path.replace("NNNN", "[0-9]" * 4).replace("_name", "_*")  # a template: vNNNN_name.py
        if not any(ROOT.glob(pattern)):
            broken.append(path)
    assert not broken, f"{doc} names what does not exist: {broken}"


#: Names the four documents tell a user to import or call (``module.attr``).
DOCUMENTED_NAMES = """
ucm_db.open ucm_db.Namespace ucm_db.Store ucm_db.Framed ucm_db.ScatterSlabs ucm_db.STORE_FORMAT_VERSION
ucm_db.load_config_file ucm_db.config.StoreConfig ucm_db.config.file.MAX_CONFIG_FILE_BYTES
ucm_db.config.file.MAX_CONFIG_DEPTH ucm_db.codec.MAX_RAW_BYTES ucm_db.codec.batch_loads.FLUSH_UNITS
ucm_db.remote.warming.RemoteEpochUnknownError ucm_db.committer.CommitProcess ucm_db.committer.SharedChain
ucm_db.committer.Committed ucm_db.committer.CommitProcess.share ucm_db.committer.CommitProcess.locate
ucm_db.committer.CommitProcess.put_segments ucm_db.ScatterSlabs.gather_into ucm_db.ScatterSlabs.row_bytes
ucm_db.maintenance.inspect ucm_db.maintenance.iter_blocks ucm_db.maintenance.namespaces ucm_db.maintenance.verify
ucm_db.maintenance.evict_to_bytes ucm_db.maintenance.compact ucm_db.maintenance.export_archive
ucm_db.maintenance.import_archive ucm_db.maintenance.invalidate ucm_db.maintenance.gc_remote
ucm_db.maintenance.iter_events ucm_db.maintenance.remote_namespace ucm_db.maintenance.pin ucm_db.maintenance.unpin
ucm_db.maintenance.lookup ucm_db.maintenance.whole_model_units ucm_db.maintenance.isolation
ucm_db.migrations.pending ucm_db.migrations.applied ucm_db.migrations.migrate
ucm_db.Store.lookup ucm_db.Store.get ucm_db.Store.put ucm_db.Store.get_into ucm_db.Store.touch ucm_db.Store.stats
ucm_db.Store.delete ucm_db.Store.bump_epoch ucm_db.Store.epoch ucm_db.Store.warm ucm_db.Store.quarantine
ucm_db.Store.put_encoded ucm_db.Store.put_segments ucm_db.Store.pin ucm_db.Store.unpin ucm_db.Store.flush
""".split()


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def test_every_name_the_docs_tell_a_user_to_use_exists() -> None:
    missing = []
    for name in DOCUMENTED_NAMES:
        try:
            _resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert not missing
    # Keyword arguments the documents pass (api.md, README).
    import inspect

    signatures = {
        "delete": "remote", "quarantine": "recheck", "get_into": "touch", "put": "codec_name", "put_segments": "codec_name",
    }
    lacking = {m: kw for m, kw in signatures.items() if kw not in inspect.signature(getattr(ucm_db.Store, m)).parameters}
    assert not lacking


# -- the Python API snippets --------------------------------------------------------------------
def _snippet(doc: str) -> str:
    """The first ```python block of ``doc``."""
    return re.search(r"```python\n(.*?)```", _text(doc), flags=re.DOTALL)[1]  # type: ignore[index]


@pytest.mark.parametrize("doc", ["README.md", "docs/api.md"])
def test_the_python_api_snippet_runs_as_written_and_does_what_its_comments_say(tmp_path: Path, doc: str) -> None:
    """The snippet on a store holding the prompt's first two blocks: a
    lookup finds them, ``get`` and ``get_into`` read them, the put stores
    the other two under the right parent, and stats() prints."""
    code = _snippet(doc)
    assert code.count('"/var/cache/ucm-db"') == 1
    path = tmp_path / "store"
    code = code.replace('"/var/cache/ucm-db"', repr(str(path)))
    tokens, salt = list(range(4 * 16 + 5)), "tenant-a"
    payloads = [bytes([i + 1]) * 2048 for i in range(4)]
    ns_args = {"model": "meta-llama/Llama-3.1-8B", "kv_dtype": "bfloat16", "block_size": 16}
    ns = ucm_db.Namespace(**ns_args)
    assert ns.id == ucm_db.Namespace(**ns_args, tp_rank=0, tp_size=1).id  # README's and api.md's are one namespace
    first = ns.block_keys(tokens, extras={"cache_salt": salt})
    with ucm_db.open(path, capacity_bytes=200 << 30, codec="zstd", durability="group") as store:
        store.put(ns, first[:2], payloads[:2])
    scope: dict[str, Any] = {"prompt_token_ids": tokens, "salt": salt, "new_payloads": payloads[2:],
                             "buffers": [bytearray(2048) for _ in range(2)]}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, doc, "exec"), scope)  # noqa: S102 - the document's own code, on a temp store
    assert [len(k) for k in scope["keys"]] == [32] * 4  # "one 32-byte key per full block"
    assert scope["n"] == 2  # "leading blocks stored"
    assert [bytes(b) for b in scope["blocks"]] == payloads[:2]
    assert [bytes(b) for b in scope["buffers"]] == payloads[:2]  # "decode straight into caller buffers"
    assert "'blocks': 4" in out.getvalue()
    with ucm_db.open(path) as store:
        assert store.lookup(ns, first) == 4
        assert [bytes(b) for b in store.get(ns, first)] == payloads  # type: ignore[arg-type]


# -- the connector rows of the README's table -------------------------------------------------------
def _connector_rows() -> dict[str, str]:
    table = _text("README.md").split("| **connector keys** |", 1)[1].split("\n\n", 1)[0]
    return dict(re.findall(r"^\| `(\w+)` \| ([^|]*?) \|", table, flags=re.MULTILINE))


def _cell_value(cell: str) -> Any:
    if cell.startswith("none"):
        return None
    sized = re.fullmatch(r"(\d+) GiB", cell)
    if sized:
        return int(sized[1]) << 30
    word = cell.strip("`")
    return {"true": True, "false": False}.get(word, int(word) if word.isdigit() else float(word) if word[0].isdigit() else word)


def test_readme_connector_defaults_are_the_connectors() -> None:
    from ucm_db.connector.settings import ConnectorSettings

    rows = _connector_rows()
    assert rows.pop("path").startswith("`$UCM_DB_PATH`")  # tests/connector/test_settings.py holds the order
    assert rows.pop("config_file") == "none"
    settings = ConnectorSettings.from_extra_config({})
    wrong = {name: (cell, getattr(settings, name, "(no such key)")) for name, cell in rows.items()
             if _cell_value(cell) != getattr(settings, name, "(no such key)")}
    assert not wrong, f"README default -> the connector's: {wrong}"


#: Values the README's connector rows (and docs/configuration.md) name: taken; and one each refuses.
CONNECTOR_VALUES = [
    ("load_mode", ["block", "layer", "async"], "later"),
    ("publish", ["local", "remote"], "s3"),
    ("publish_codec", ["none", "zstd", "store"], "lz4"),
    ("load_policy", ["auto", "always"], "never"),
    ("remote_lookup", ["inline", "background"], "later"),
    ("admit_after", [1, 2, "auto"], 0),
    ("save_process", [True, False, "auto"], "sometimes"),
    ("load_threads", ["auto", 1, 64], 65),
    ("save_decode", [True, False], "maybe"),
    ("store_foreign_loads", [True, False], "maybe"),
]


@pytest.mark.parametrize(("key", "taken", "refused"), CONNECTOR_VALUES, ids=[row[0] for row in CONNECTOR_VALUES])
def test_the_connector_values_the_docs_name_are_taken_and_others_refused(key: str, taken: list[Any], refused: Any) -> None:
    from ucm_db.connector.settings import ConnectorSettings

    for value in taken:
        assert getattr(ConnectorSettings.from_extra_config({key: value}), key) == value
    with pytest.raises(ucm_db.ConfigError, match=key):
        ConnectorSettings.from_extra_config({key: refused})


# -- the connector's command line ---------------------------------------------------------------------
def test_the_readme_kv_transfer_config_names_real_fields_and_settings_the_connector_takes() -> None:
    """The README's ``--kv-transfer-config`` parses as JSON, names the
    connector class ``ucm_db.connector`` exports and vLLM's own fields (read
    from vLLM's source, not imported: that takes seconds), and its extra
    config is settings the connector takes as they are."""
    import ast
    import importlib.util
    import json

    from ucm_db.connector.settings import ConnectorSettings

    block = _text("README.md").split("## The vLLM connector", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    config = json.loads(block[block.index("'") + 1:block.rindex("'")])
    assert (config["kv_connector"], config["kv_connector_module_path"]) == ("UcmDbConnector", "ucm_db.connector")
    import ucm_db.connector

    assert config["kv_connector"] in ucm_db.connector.__all__
    source = ROOT / "connector" / "connector.py"
    assert "UcmDbConnector" in {node.name for node in ast.parse(source.read_text()).body if isinstance(node, ast.ClassDef)}
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    vllm_config = (Path(spec.submodule_search_locations[0]) / "config" / "kv_transfer.py").read_text(encoding="utf-8")
    for field in config:
        assert re.search(rf"^    {field}: ", vllm_config, flags=re.MULTILINE), f"vLLM's KVTransferConfig has no {field}"
    assert re.search(r'kv_load_failure_policy: Literal\[[^\]]*"recompute"', vllm_config)
    assert f'"{config["kv_role"]}"' in vllm_config.split("KVRole = ", 1)[0]  # one of the roles vLLM declares
    settings = ConnectorSettings.from_extra_config(config["kv_connector_extra_config"])
    assert str(settings.path) == "/var/cache/ucm-db"
    assert dict(settings.store_options) == {"codec": "zstd", "capacity_bytes": 200 << 30}  # the Python API's 200 GiB
