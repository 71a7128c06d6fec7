"""Every field of a :class:`~ucm_db.Namespace` is checked for its type, so a
description read from JSON (an archive's manifest, a remote manifest) that
holds another type is a ConfigError naming the field, never a traceback
(audit: ``layout`` as an object or ``extra`` as a list hashed into a
namespace id, then failed deep in the put with ``TypeError: unhashable type``,
after ``import`` had created the store and registered the epoch)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from ucm_db import Namespace, maintenance
from ucm_db.errors import ConfigError
from ucm_db.remote.warming import remote_namespaces

BASE: dict[str, Any] = {"model": "m", "kv_dtype": "bfloat16", "block_size": 4}
BAD = [("layout", {"x": 1}), ("layout", 5), ("layout", None), ("extra", [1, 2]), ("extra", b"x"),
       ("key_scheme", "abc"), ("key_scheme", True), ("key_scheme", -1), ("key_scheme", 1.0), ("key_scheme", [1])]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}-{type(v).__name__}-{v!r}" for f, v in BAD])
def test_a_field_of_the_wrong_type_is_a_config_error_naming_it(field: str, value: Any) -> None:
    for build in (lambda: Namespace(**BASE, **{field: value}), lambda: Namespace.from_dict({**BASE, field: value})):
        with pytest.raises(ConfigError, match=f"^Namespace.{field} must be ") as caught:
            build()
        assert caught.value.hint


def test_valid_fields_still_pass() -> None:
    for fields in ({"layout": "", "extra": ""}, {"layout": '{"heads": 8}', "extra": "q"}, {"key_scheme": 0}, {"key_scheme": 2}):
        namespace = Namespace(**BASE, **fields)
        assert Namespace.from_dict(json.loads(namespace.description_json)) == namespace


@pytest.mark.parametrize("data", [5, None, [["model", "m"]], "model"])
def test_a_description_that_is_no_mapping_is_a_config_error(data: Any) -> None:
    with pytest.raises(ConfigError):
        Namespace.from_dict(data)


def _namespace_id(description: dict[str, Any]) -> str:
    """The id a description hashes to, as ucm-db derives it (keys/__init__.py)."""
    body = json.dumps(description, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(b"ucm-db/namespace\0" + body.encode()).digest()[:16].hex()


def _rewrite(archive: Path, out: Path, field: str, value: Any) -> None:
    """``archive`` with its namespace's ``field`` set to ``value``, renamed to
    the id that description hashes to (as a crafted archive would be)."""
    with tarfile.open(archive) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.name != "manifest.json"}  # type: ignore[union-attr]
    [(old, description)] = manifest["namespaces"].items()
    description = {**description, field: value}
    new = _namespace_id(description)
    manifest["namespaces"], manifest["epochs"] = {new: description}, {new: manifest["epochs"][old]}
    manifest["blocks"] = [[key, parent, new] for key, parent, _ in manifest["blocks"]]
    with tarfile.open(out, "w") as tar:
        for name, data in [("manifest.json", json.dumps(manifest).encode()), *members.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize(("field", "value"), [("layout", {"x": 1}), ("extra", [1, 2]), ("key_scheme", "abc")])
def test_import_refuses_a_description_of_the_wrong_type_before_creating_the_store(
    tmp_path: Path, field: str, value: Any,
) -> None:
    namespace = Namespace(**BASE)
    with ucm_db.open(tmp_path / "s") as store:
        store.put(namespace, namespace.block_keys(list(range(16))), [bytes([i]) * 256 for i in range(4)])
    maintenance.export_archive(tmp_path / "s", tmp_path / "good.tar")
    _rewrite(tmp_path / "good.tar", tmp_path / "bad.tar", field, value)
    with pytest.raises(ConfigError, match=f"invalid description: Namespace.{field} must be "):
        maintenance.import_archive(tmp_path / "bad.tar", tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_a_remote_manifest_of_the_wrong_type_is_skipped_with_its_problem(tmp_path: Path) -> None:
    """A manifest whose description hashes to its own directory's id but
    holds an object as ``layout``: skipped and named, never a namespace."""
    root = tmp_path / "remote"
    description = {**Namespace(**BASE).to_dict(), "layout": {"x": 1}}
    short_id = _namespace_id(description)[:16]
    (root / short_id).mkdir(parents=True)
    (root / short_id / "manifest.json").write_text(json.dumps({"namespace_id": _namespace_id(description), "namespace": description}))
    found = remote_namespaces(f"file://{root}")
    assert found.namespaces == {}
    assert len(found.problems) == 1 and "Namespace.layout must be a string" in found.problems[0]
    with pytest.raises(ConfigError, match="0 namespaces"):
        maintenance.remote_namespace(f"file://{root}", {}, "m")
