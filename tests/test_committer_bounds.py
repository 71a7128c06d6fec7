"""A commit process stores a chain's units only where each lies whole inside
its shared buffer: ``unit_bytes > 0``, ``offset >= 0``, ``stride_bytes >=
unit_bytes`` and the last unit's end within the buffer, else a ConfigError
and nothing stored. Before, the child sliced with Python's rules: units
past the end were stored as short or empty blocks, a negative offset
stored another unit's bytes under a key, ``unit_bytes=0`` an empty block.
The caller checks, and the child checks again (a request sent around the
caller's check is refused the same way). A real child process on a real
store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ucm_db
from ucm_db.committer import CommitProcess, SharedChain, wire
from ucm_db.errors import ConfigError

NS = ucm_db.Namespace(model="committer-bounds", kv_dtype="bfloat16", block_size=4)
OPTIONS = {"codec": "none", "check_on_open": "none"}
UNIT = 4096

#: name -> (first token, blocks, offset, stride_bytes, unit_bytes), in a buffer of 4 units.
REFUSED = {
    "units past the end": (0, 4, 2 * UNIT, UNIT, UNIT),
    "last unit one byte past the end": (100, 2, 2 * UNIT + 1, UNIT, UNIT),
    "negative offset": (200, 1, -2 * UNIT, UNIT, UNIT),
    "unit_bytes 0": (300, 1, 0, UNIT, 0),
    "negative unit_bytes": (400, 1, 0, UNIT, -UNIT),
    "stride below unit_bytes": (500, 2, 0, UNIT // 2, UNIT),
}


def _chain(buffer_id: int, first: int, blocks: int, offset: int, stride: int, unit_bytes: int) -> SharedChain:
    return SharedChain(NS.block_keys(list(range(first, first + 4 * blocks))), buffer_id, offset, stride, unit_bytes)


@pytest.fixture
def committer(tmp_path: Path):  # type: ignore[no-untyped-def]
    ucm_db.open(tmp_path / "s", **OPTIONS).close()
    with CommitProcess(tmp_path / "s", OPTIONS) as process:
        yield process


def _stored(path: Path, chain: SharedChain) -> list[object]:
    with ucm_db.open(path, **OPTIONS) as store:
        return store.get(NS, list(chain.keys))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_units_outside_the_buffer_are_refused_and_nothing_is_stored(committer: CommitProcess, tmp_path: Path, name: str) -> None:
    buffer = committer.share(4 * UNIT)
    np.frombuffer(buffer.memory, dtype=np.uint8)[:] = np.repeat(np.arange(1, 5, dtype=np.uint8), UNIT)
    chain = _chain(buffer.id, *REFUSED[name])
    with pytest.raises(ConfigError) as raised:
        committer.put_segments(NS, [chain])
    assert raised.value.hint
    assert _stored(tmp_path / "s", chain) == [None] * len(chain.keys)
    assert committer.alive  # refused before anything was sent: the child serves on


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_the_child_refuses_them_too(committer: CommitProcess, tmp_path: Path, name: str) -> None:
    """A request that skipped the caller's check (sent as put_segments
    would send it): the child's own check refuses it before any slice."""
    buffer = committer.share(4 * UNIT)
    chain = _chain(buffer.id, *REFUSED[name])
    body = {"ns": NS.to_dict(), "codec": None, "frame_bytes": None, "events": None,
            "chains": [{"keys": [k.hex() for k in chain.keys], "parent": None, "buf": buffer.id, "offset": chain.offset,
                        "stride": chain.stride_bytes, "unit_bytes": chain.unit_bytes}]}
    with pytest.raises(ConfigError):
        committer._call(wire.PUT, body)
    assert _stored(tmp_path / "s", chain) == [None] * len(chain.keys)


def test_a_buffer_not_shared_is_refused(committer: CommitProcess) -> None:
    with pytest.raises(ConfigError, match="buffer"):
        committer.put_segments(NS, [_chain(987654, 0, 1, 0, UNIT, UNIT)])


def test_units_filling_the_buffer_exactly_back_to_back_or_strided_are_stored(committer: CommitProcess, tmp_path: Path) -> None:
    buffer = committer.share(4 * UNIT)
    rows = np.frombuffer(buffer.memory, dtype=np.uint8)
    rows[:] = np.repeat(np.arange(1, 5, dtype=np.uint8), UNIT)
    back_to_back = _chain(buffer.id, 0, 4, 0, UNIT, UNIT)  # stride == unit_bytes, ends at the buffer's last byte
    strided = _chain(buffer.id, 1000, 2, UNIT, 2 * UNIT, UNIT)  # units 2 and 4
    short_units = _chain(buffer.id, 2000, 4, 0, UNIT, UNIT // 2)  # the first half of each unit
    assert len(committer.put_segments(NS, [back_to_back, strided, short_units]).stored_keys) == 10
    assert [g[0] for g in _stored(tmp_path / "s", back_to_back)] == [1, 2, 3, 4]  # type: ignore[index]
    assert [g[0] for g in _stored(tmp_path / "s", strided)] == [2, 4]  # type: ignore[index]
    assert [len(g) for g in _stored(tmp_path / "s", short_units)] == [UNIT // 2] * 4  # type: ignore[arg-type]
