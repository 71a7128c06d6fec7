"""docs/connector.md's and docs/tp.md's promises that hold without a vLLM
engine, each checked against the code with the document's own words beside
it, so that a change to either side fails here:

* the settings (``kv_connector_extra_config``): every key the document
  names is taken, its default is the one stated, every choice list is the
  code's, a bad value is a ``ConfigError`` with a hint, an unknown key
  lists the valid ones, keys given directly win over ``config_file``, and
  ``path`` defaults to ``$UCM_DB_PATH``, else ``$XDG_CACHE_HOME/ucm-db``,
  else ``~/.cache/ucm-db``;
* the refusal of ``admit_after`` >= 2 on a ``kv_producer``, worded as quoted;
* the per-request controls table (malformed values fail closed);
* the figures the document quotes that are code constants (the sketch, the
  writer's linger, staging kept, chunks, background lookups, probes);
* every metric the documents name is exported; the names, files and
  role refusals the document gives.

docs/tp.md: tests/test_audit_docs2_tp.py.

Importing ``ucm_db.connector`` needs vLLM (installed in the dev env); no
engine is started.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import ConfigError

pytest.importorskip("vllm")  # ucm_db.connector imports vLLM

ROOT = Path(__file__).resolve().parents[1]
CONNECTOR = (ROOT / "docs" / "connector.md").read_text(encoding="utf-8")


def _settings() -> Any:
    from ucm_db.connector.settings import ConnectorSettings

    return ConnectorSettings


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


# -- settings ---------------------------------------------------------------------------------------
#: (key, the words connector.md says of its default, the default).
DEFAULTS = [
    ("load_mode", "`load_mode` (`block`;", "block"),
    ("load_policy", "With `load_policy: \"auto\"` (default)", "auto"),
    ("remote_lookup", "With `inline` (the default)", "inline"),
    ("publish_codec", "(`publish_codec: \"none\"`", "none"),
    ("save_decode", "`save_decode` (default `true`)", True),
    ("admit_after", "default 1 = store every block", 1),
    ("save_process", "(`save_process`, default `auto`)", "auto"),
    ("model_id", "`model_id` (an explicit model identity; by default the model is keyed by a digest", None),
    ("store_foreign_loads", "`store_foreign_loads: true` stores it", False),
]

#: (key, a value the document names as taken).
TAKEN = [
    ("load_mode", "layer"), ("load_mode", "async"), ("load_policy", "always"), ("remote_lookup", "background"),
    ("publish_codec", "store"), ("publish_codec", "zstd"), ("publish", "local"), ("save_decode", False),
    ("admit_after", 255), ("admit_after", "auto"), ("save_process", True), ("save_process", False),
    ("store_foreign_loads", True), ("model_id", "my-model"), ("load_deadline_s", 0), ("load_deadline_s", 600),
    ("load_threads", 4), ("remote_read_concurrency", 64), ("read_only", True),
]

#: (key, a refused value, a fragment of the message).
REFUSED = [
    ("load_mode", "stream", "load_mode"), ("load_policy", "never", "load_policy"), ("remote_lookup", "async", "remote_lookup"),
    ("publish_codec", "lz4", "publish_codec"), ("publish", "s3", "publish"), ("save_decode", "yes", "save_decode"),
    ("admit_after", 0, "[1, 255]"), ("admit_after", 256, "[1, 255]"), ("admit_after", True, "admit_after"),
    ("save_process", "yes", "save_process"), ("store_foreign_loads", 1, "store_foreign_loads"),
    ("load_deadline_s", 601, "load_deadline_s"), ("model_id", "", "model_id"), ("max_pending_save_bytes", 1000, "max_pending_save_bytes"),
    ("path", "", "path"), ("path", "a\0b", "path"), ("config_file", "", "config_file"), ("codec", "lz4", "codec"),
]


def test_each_documented_default_is_the_settings_default(tmp_path: Path) -> None:
    settings = _settings().from_extra_config({"path": str(tmp_path)})
    wrong = [(key, getattr(settings, key), default) for key, said, default in DEFAULTS
             if said not in _flat(CONNECTOR) or getattr(settings, key) != default]
    assert not wrong, f"(key, the code's default, the document's): {wrong}"


def test_documented_values_are_taken_and_bad_ones_refused_with_a_hint(tmp_path: Path) -> None:
    cls = _settings()
    for key, value in TAKEN:
        assert f"`{key}`" in CONNECTOR or f"`{key}:" in CONNECTOR or key in ("read_only", "remote_read_concurrency")
        settings = cls.from_extra_config({"path": str(tmp_path), key: value})
        got = settings.store_options[key] if key in settings.store_options else getattr(settings, key)
        assert got == value, key
    wrong = []
    for key, value, fragment in REFUSED:
        try:
            cls.from_extra_config({"path": str(tmp_path), key: value})
        except ConfigError as exc:
            if fragment not in str(exc) or not exc.hint:
                wrong.append((key, value, str(exc)))
        else:
            wrong.append((key, value, "taken"))
    assert not wrong, wrong


def test_unknown_keys_stop_with_the_valid_ones_and_direct_keys_win_over_the_file(tmp_path: Path) -> None:
    """"An unknown key stops the engine at start-up with the list of valid
    keys"; ``config_file``: "keys given directly win"."""
    from ucm_db.connector.settings import valid_keys

    cls = _settings()
    with pytest.raises(ConfigError, match="colour") as info:
        cls.from_extra_config({"path": str(tmp_path), "colour": "blue"})
    assert all(key in info.value.hint for key in ("load_mode", "capacity_bytes", "admit_after", "config_file"))
    documented = {"path", "config_file", "load_mode", "model_id", "max_pending_save_bytes", "publish", "publish_codec",
                  "load_deadline_s", "load_policy", "remote_lookup", "save_decode", "admit_after", "save_process",
                  "load_threads", "store_foreign_loads"}
    assert documented <= set(valid_keys()) and all(f"`{key}`" in CONNECTOR or f"`{key}:" in CONNECTOR for key in documented)
    config = tmp_path / "ucm.yaml"
    config.write_text("codec: none\nload_mode: layer\nadmit_after: 2\n")
    settings = cls.from_extra_config({"path": str(tmp_path), "config_file": str(config), "load_mode": "async"})
    assert (settings.load_mode, settings.admit_after, settings.store_options["codec"]) == ("async", 2, "none")
    # "YAML without aliases (an anchor alone is harmless)": an anchor nothing refers to is taken, an alias refused.
    assert "YAML without aliases (an anchor alone is harmless)" in _flat(CONNECTOR)
    config.write_text("codec: &c none\n")
    assert cls.from_extra_config({"path": str(tmp_path), "config_file": str(config)}).store_options["codec"] == "none"
    config.write_text("codec: &c none\nremote_codec: *c\n")
    with pytest.raises(ConfigError, match="alias"):
        cls.from_extra_config({"path": str(tmp_path), "config_file": str(config)})
    config.write_text("colour: blue\n")
    with pytest.raises(ConfigError, match="colour"):  # unknown keys in the file too
        cls.from_extra_config({"path": str(tmp_path), "config_file": str(config)})


def test_the_default_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    said = "`path` (default: `$UCM_DB_PATH`, else `$XDG_CACHE_HOME/ucm-db`, else `~/.cache/ucm-db`)"
    assert said in _flat(CONNECTOR)
    cls = _settings()
    monkeypatch.setenv("UCM_DB_PATH", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cls.from_extra_config({}).path == tmp_path / "explicit"
    monkeypatch.delenv("UCM_DB_PATH")
    assert cls.from_extra_config({}).path == tmp_path / "xdg" / "ucm-db"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cls.from_extra_config({}).path == tmp_path / "home" / ".cache" / "ucm-db"


def test_a_kv_producer_refuses_admit_after_two_as_quoted() -> None:
    from ucm_db.connector.admission import Admission

    quoted = "`ConfigError: admit_after 2 on a kv_producer would publish nothing of a prompt's first sightings ...`"
    assert quoted in _flat(CONNECTOR)
    with pytest.raises(ConfigError) as info:
        Admission(True, 2, publishes=True)
    assert str(info.value).startswith("admit_after 2 on a kv_producer would publish nothing of a prompt's first sightings")
    assert 'admit_after=1' in info.value.hint and '"auto"' in info.value.hint and "kv_both" in info.value.hint
    Admission(True, "auto", publishes=True)  # "`"auto"` is 1 there"
    Admission(True, 1, publishes=True)


# -- per-request controls ------------------------------------------------------------------------------
#: (connector.md's row, the ``ucm_db`` body sent, (save, load, max_load_tokens) served).
CONTROLS = [
    ("`save` neither a bool nor `\"always\"` (`\"false\"`, `0`, `\"no\"`)", [{"save": "false"}, {"save": 0}, {"save": "no"}],
     (False, True, None)),
    ("`load` not a bool", [{"load": 1}, {"load": "true"}], (True, False, None)),
    ("`max_load_tokens` not an integer >= 0 (`-3`, `\"12\"`, `12.5`, `true`)",
     [{"max_load_tokens": -3}, {"max_load_tokens": "12"}, {"max_load_tokens": 12.5}, {"max_load_tokens": True}], (True, True, 0)),
    ("`ucm_db` not an object (a list, a string), or unreadable", [[1, 2], "save"], (False, False, None)),
    ("| an unknown field | ignored |", [{"colour": "red"}], (True, True, None)),
    ("| `null` | absent: the default |", [None, {"save": None, "load": None, "max_load_tokens": None}], (True, True, None)),
]


def test_each_malformed_control_is_served_as_the_table_says() -> None:
    from ucm_db.connector.request_controls import RequestControls

    wrong = []
    for row, bodies, served in CONTROLS:
        assert row in CONNECTOR, row
        for body in bodies:
            controls, problems = RequestControls.from_params({"ucm_db": body})
            got = (controls.save, controls.load, controls.max_load_tokens)
            if got != served or (served != (True, True, None)) != bool(problems) and "unknown" not in row:
                wrong.append((body, got, problems))
    assert not wrong, wrong
    controls, problems = RequestControls.from_params({"ucm_db": {f"f{i}": 1 for i in range(8)}})
    assert sum(p.startswith("unknown field '") for p in problems) == 5 and "3 more" in problems[-1]  # "at most 5 unknown fields are named"
    assert RequestControls.from_params({"ucm_db": {"save": "always"}})[0].save == "always"
    # The warning line, word for word as quoted (its "(controls: ...)" tail elided there).
    from ucm_db.connector.request_controls import describe_problems

    quoted = re.search(r"`ucm-db: request cmpl-1-0: (bad controls in .*?) \(controls: \.\.\.\)`", _flat(CONNECTOR))
    assert quoted, "connector.md no longer quotes the bad-controls warning"
    line = describe_problems(RequestControls.from_params({"ucm_db": {"save": "no", "colour": 1}})[1])
    assert line.startswith(quoted[1] + " (controls: ")
    assert RequestControls.from_params({"other_connector": {"save": False}})[0] == RequestControls()  # not read


# -- figures the document quotes ------------------------------------------------------------------------
def test_the_figures_connector_md_quotes_are_the_codes() -> None:
    from ucm_db.connector.auto_admission import (
        HALF_LIFE_BLOCKS, HIGH_SHARE, LOW_SHARE, MIN_EVIDENCE_BLOCKS, MIN_SAMPLED_BLOCKS, SAMPLE_ONE_IN, SAMPLE_ROOT_TOKENS,
    )
    from ucm_db.connector.device_saves import GATHER_CHUNK_BYTES
    from ucm_db.connector.hybrid.ssm_state import MAX_PROBES
    from ucm_db.connector.metrics import GAUGE_INTERVAL_S
    from ucm_db.connector.admission import MAX_ADMIT_AFTER
    from ucm_db.connector.scheduler.lookups import PROBE_BLOCKS
    from ucm_db.connector.scheduler.remote_lookups import LOOKUP_THREADS
    from ucm_db.connector.sighting_sketch import SKETCH_DEPTH, SKETCH_HALVE_EVERY, SKETCH_WIDTH, SightingSketch
    from ucm_db.connector.worker import hooks, writer
    from ucm_db.connector.worker.device_loads import CHUNK_BYTES
    from ucm_db.config import StoreConfig

    flat = _flat(CONNECTOR)
    quoted = [
        ("With `background`, up to 4 lookups run on connector threads", LOOKUP_THREADS, 4),
        ("with the default 16 threads", StoreConfig(remote="memory://audit-docs2").remote_read_concurrency, 16),
        ("once committed, up to 256 MiB of that staging", hooks._MAX_FREE_STAGING_BYTES, 256 << 20),
        ("waits up to 20 ms for more when its queue runs dry", writer.LINGER_S, 0.02),
        ("stages through two 128 MiB chunks", CHUNK_BYTES, 128 << 20),
        ("gathers through two 128 MiB device chunks", GATHER_CHUNK_BYTES, 128 << 20),
        ("gets a 16-block probe load first", PROBE_BLOCKS, 16),
        ("8 boundaries at most", MAX_PROBES, 8),
        ("(at most every 2 s)", GAUGE_INTERVAL_S, 2.0),
        ("integer in [1, 255] or `\"auto\"`", MAX_ADMIT_AFTER, 255),
        ("4 rows of 4,194,304 one-byte counters (16 MiB", (SKETCH_DEPTH, SKETCH_WIDTH, SightingSketch().nbytes), (4, 4194304, 16 << 20)),
        ("halved after each 1,048,576 block sightings", SKETCH_HALVE_EVERY, 1_048_576),
        ("stays there for the first 1024 blocks", MIN_EVIDENCE_BLOCKS, 1024),
        ("whose weights halve every 2048 blocks", HALF_LIFE_BLOCKS, 2048),
        ("when under 5% of the blocks were seen before, and back to 1 at 10% or more", (LOW_SHARE, HIGH_SHARE), (0.05, 0.10)),
        ("At N=2 one chain in 16 is still stored from its first sighting", SAMPLE_ONE_IN, 16),
        ("those whose first 16 token ids are picked", SAMPLE_ROOT_TOKENS, 16),
        ("once their own share (from 256 of their blocks) reaches 10%", (MIN_SAMPLED_BLOCKS, HIGH_SHARE), (256, 0.10)),
    ]
    wrong = [(said, actual) for said, actual, stated in quoted if said not in flat or actual != stated]
    assert not wrong, f"quoted figure (or its words) -> the code's value: {wrong}"


def test_every_metric_the_documents_name_is_exported() -> None:
    """connector.md's and fleet.md's ``vllm:ucm_db_*`` names: a ``_total`` is
    a counter (Prometheus adds the suffix), the rest gauges or histograms."""
    from ucm_db.connector import metrics

    fleet = (ROOT / "docs" / "fleet.md").read_text(encoding="utf-8")
    named = set(re.findall(r"vllm:(ucm_db_\w+?)`", CONNECTOR + fleet))
    assert len(named) >= 20
    counters = {name for name, _ in metrics._PROM.values()}
    others = {name for name, _ in (*metrics._PROM_GAUGES.values(), *metrics._PROM_HISTOGRAMS.values())}
    missing = [n for n in named if (n.removesuffix("_total") not in counters if n.endswith("_total") else n not in others)]
    assert not missing, f"metrics the documents name that the connector does not export: {missing}"


def test_odd_settings_are_one_short_refusal_and_a_reset_epoch_is_private(tmp_path: Path) -> None:
    """"A bad value is described briefly in the line (a 10 MB string as its
    first 40 characters and its length)"; a ``path`` of an unknown user's
    ``~user`` is a ConfigError; ``publish: "remote"`` needs a remote; an
    engine's reset roots its chains "at or above 2^63"."""
    from ucm_db.connector.epochs import private_epoch
    from ucm_db.connector.roles import producer_store_options

    assert "(a 10 MB string as its first 40 characters and its length)" in _flat(CONNECTOR)
    with pytest.raises(ConfigError) as info:
        _settings().from_extra_config({"path": str(tmp_path), "load_mode": "x" * 10_000_000})
    assert len(str(info.value)) < 400 and "x" * 40 + "'... (10000000 characters)" in str(info.value)
    with pytest.raises(ConfigError, match="unknown user"):
        _settings().from_extra_config({"path": "~no-such-user-audit-docs2/ucm"})
    with pytest.raises(ConfigError, match="needs a remote tier"):
        producer_store_options({}, "remote")
    assert producer_store_options({"remote": "file:///x"}, "remote")["remote_mode"] == "write_through"
    assert "(at or above 2^63, drawn anew at each of its resets)" in _flat(CONNECTOR)
    assert all(1 << 63 <= private_epoch(epoch, bytes([epoch % 256]) * 16) < 1 << 64 for epoch in (0, 1, 7, (1 << 63) - 1))


def test_read_only_and_publication_settings_by_role(tmp_path: Path) -> None:
    """"`"read_only": true` in the extra config asks for it explicitly. A
    `kv_both` or `kv_producer` on such a store stops at start-up with that fix
    in its hint"; ``publish: "remote"`` on a producer needs a remote and
    writes through."""
    from ucm_db.connector.stores import role_settings

    assert "`\"read_only\": true` in the extra config asks for it explicitly" in CONNECTOR
    extra = {"path": str(tmp_path / "s"), "read_only": True}
    for role in ("kv_both", "kv_producer"):
        with pytest.raises(ucm_db.TierError) as info:
            role_settings(extra, role)
        assert "kv_consumer" in info.value.hint
    settings, _ = role_settings(extra, "kv_consumer")
    assert settings.store_options["read_only"] is True
    with pytest.raises(ConfigError, match="needs a remote tier"):
        role_settings({"path": str(tmp_path / "s"), "publish": "remote"}, "kv_producer")
    settings, _ = role_settings({"path": str(tmp_path / "s"), "publish": "remote", "remote": "file:///x"}, "kv_producer")
    assert settings.store_options["remote_mode"] == "write_through"


def test_the_names_and_files_connector_md_gives(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The class vLLM is told to load, the plugin entry point that registers
    it, the commit child's module, and the fingerprint cache's place and floor."""
    import importlib.util

    import ucm_db.connector
    from ucm_db.connector.fingerprint_cache import cache_path
    from ucm_db.connector.fingerprints import PERSIST_MIN_BYTES

    assert ucm_db.connector.UcmDbConnector.__name__ == "UcmDbConnector"
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    plugins = pyproject.split('[project.entry-points."vllm.general_plugins"]', 1)[1].split("\n[", 1)[0]
    assert "ucm_db.connector.plugin" in plugins and "`vllm.general_plugins` entry point (`connector/plugin.py`" in _flat(CONNECTOR)
    assert "(`python -m ucm_db.committer.child`, no torch)" in _flat(CONNECTOR) and importlib.util.find_spec("ucm_db.committer.child")
    assert "for checkpoints of 64 MiB or more, in `$XDG_CACHE_HOME/ucm-db/fingerprints.json` (else `~/.cache/ucm-db/`)" in _flat(CONNECTOR)
    assert PERSIST_MIN_BYTES == 64 << 20
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_path() == tmp_path / "xdg" / "ucm-db" / "fingerprints.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_path() == tmp_path / "home" / ".cache" / "ucm-db" / "fingerprints.json"
