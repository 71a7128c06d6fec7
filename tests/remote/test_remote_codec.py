"""Codec per tier (issue 13 item 3): the remote tier's objects may use
another codec than the local tier; ``auto`` picks from measured speeds.

Real stores and a real ``file://`` / ``throttled://`` remote directory; the
decision rule of ``auto`` is also checked on its own with given speeds.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import ucm_db
from ucm_db import codec
from ucm_db.remote import codec_choice
from ucm_db.remote.codec_choice import PROBE_EVERY, RemoteCodec
from ucm_db.remote.tier import unpack_object
from ucm_db.tools.bench.throttle import register

NS = ucm_db.Namespace(model="remote-codec-test", kv_dtype="bfloat16", block_size=4)


def kv_like(seed: int, size_bytes: int = 256 << 10) -> bytes:
    """bf16 bit patterns of normal activations: the exponent plane
    compresses, as real K/V does."""
    values = np.random.default_rng(seed).normal(0, 1, size_bytes // 2).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def remote_objects(remote_dir: Path) -> dict[bytes, bytes]:
    """Key -> the block blob inside each remote object file."""
    out = {}
    for path in remote_dir.rglob("*"):
        if path.is_file() and len(path.name) == 64:
            key = bytes.fromhex(path.name)
            out[key] = bytes(unpack_object(path.read_bytes(), key).blob)
    return out


def put_and_upload(path: Path, remote: str, options: dict, payloads: list[bytes]) -> list[bytes]:
    keys = NS.block_keys(list(range(len(payloads) * NS.block_size)))
    with ucm_db.open(path, codec="none", capacity_bytes=1 << 30, remote=remote, **options) as store:
        store.put(NS, keys, payloads)
        store.flush(upload_timeout_s=60)
    return keys


@pytest.mark.parametrize("remote_codec, expected", [("zstd", "zstd"), ("none", "none"), ("same", "none")])
def test_remote_objects_use_the_remote_codec_and_read_back_whole(tmp_path: Path, remote_codec: str, expected: str) -> None:
    payloads = [kv_like(i) for i in range(4)]
    remote = f"file://{tmp_path / 'remote'}"
    keys = put_and_upload(tmp_path / "a", remote, {"remote_codec": remote_codec}, payloads)
    objects = remote_objects(tmp_path / "remote")
    assert set(objects) == set(keys)
    assert {codec.codec_of_head(blob) for blob in objects.values()} == {expected}
    with ucm_db.open(tmp_path / "a") as store:  # the local copies keep the local codec
        heads = store._tier.engine.read(lambda txn: [bytes(txn.get("heads", k)) for k in keys])
        assert {codec.codec_of_head(h) for h in heads} == {"none"}
    with ucm_db.open(tmp_path / "b", codec="none", capacity_bytes=1 << 30, remote=remote) as fresh:
        assert fresh.lookup(NS, keys) == 4
        assert [bytes(b) for b in fresh.get(NS, keys)] == payloads


def test_a_transcoded_object_is_bound_to_its_key(tmp_path: Path) -> None:
    """A re-encoded object is sealed for its own key: served under another
    key's name, it is a miss, not wrong bytes."""
    payloads = [kv_like(i) for i in range(2)]
    remote_dir = tmp_path / "remote"
    keys = put_and_upload(tmp_path / "a", f"file://{remote_dir}", {"remote_codec": "zstd"}, payloads)
    paths = {p.name: p for p in remote_dir.rglob("*") if p.is_file() and len(p.name) == 64}
    first, second = paths[keys[0].hex()], paths[keys[1].hex()]
    second.write_bytes(first.read_bytes())  # key 1's path now holds key 0's object
    with ucm_db.open(tmp_path / "b", codec="none", capacity_bytes=1 << 30, remote=f"file://{remote_dir}") as fresh:
        blocks = fresh.get(NS, keys)
        assert bytes(blocks[0]) == payloads[0] and blocks[1] is None


def test_auto_compresses_over_a_slow_link(tmp_path: Path) -> None:
    register()
    payloads = [kv_like(i) for i in range(24)]
    remote = "throttled://kv"
    options = {"remote_codec": "auto", "remote_options": {"path": str(tmp_path / "remote"), "bandwidth_bytes_per_s": 20e6}}
    keys = NS.block_keys(list(range(len(payloads) * NS.block_size)))
    with ucm_db.open(tmp_path / "a", codec="none", capacity_bytes=1 << 30, remote=remote, **options) as store:
        store.put(NS, keys, payloads)
        store.flush(upload_timeout_s=120)
        choice = store.stats().remote["codec"]
    assert choice["setting"] == "auto" and choice["codec"] == "zstd", choice
    assert choice["link_bytes_per_s"] < choice["compress_bytes_per_s"] * 4
    assert choice["ratio"] > 1.2
    codecs = [codec.codec_of_head(blob) for blob in remote_objects(tmp_path / "remote").values()]
    assert codecs.count("zstd") >= len(codecs) - len(codecs) // PROBE_EVERY - 1


def test_auto_decides_by_the_measured_speeds() -> None:
    """The decision rule alone, fed measured speeds (bytes/s)."""
    def decided(compress: float, link: float, ratio: float) -> str:
        chooser = RemoteCodec("auto", local_codec="none", level=1, threads=4)
        assert chooser.next_codec() == "zstd"  # nothing measured yet: compress
        chooser._observe(compress_bps=compress, ratio=ratio, link_bps=link)
        return chooser.choice().codec

    assert decided(compress=400e6, link=100e6, ratio=1.45) == "zstd"   # the link limits
    assert decided(compress=400e6, link=4e9, ratio=1.45) == "none"     # the CPU limits
    assert decided(compress=400e6, link=100e6, ratio=1.01) == "none"   # nothing to gain


def test_the_link_speed_counts_the_time_the_link_was_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes over busy time, whatever the number of uploads in flight: four
    uploads sharing the link for 0.1 s moved 4 MB (40 MB/s, not 4 x 40, nor
    the 10 of summing each upload's time), and one upload at a time moving
    1 MB per 0.1 s is 10 MB/s (not 4 x 10, as a per-upload speed times the
    thread count would say). The chooser's clock is the test's, so the
    speeds are exact on any machine."""
    now_s = [0.0]
    monkeypatch.setattr(codec_choice, "time", SimpleNamespace(perf_counter=lambda: now_s[0]))
    shared = RemoteCodec("auto", local_codec="none", level=1, threads=4)
    for _ in range(4):
        shared.send_started()
    now_s[0] += 0.1
    for _ in range(4):
        shared.send_finished(1_000_000)
    assert shared.choice().link_bytes_per_s == pytest.approx(40e6)

    alone = RemoteCodec("auto", local_codec="none", level=1, threads=4)
    for _ in range(2):
        alone.send_started()
        now_s[0] += 0.1
        alone.send_finished(1_000_000)
    assert alone.choice().link_bytes_per_s == pytest.approx(10e6)


def test_auto_keeps_probing_the_other_codec() -> None:
    chooser = RemoteCodec("auto", local_codec="none", level=1, threads=1)
    chosen = [chooser.next_codec() for _ in range(4 * PROBE_EVERY)]
    assert chosen.count("none") == 4 and chosen.count("zstd") == 4 * PROBE_EVERY - 4


def test_an_unknown_remote_codec_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ucm_db.ConfigError, match="remote_codec"):
        ucm_db.open(tmp_path / "s", remote="file:///tmp/x", remote_codec="lz4")


def test_inspect_shows_the_remote_codec_in_force(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ucm_db.tools.cli import cli

    put_and_upload(tmp_path / "a", f"file://{tmp_path / 'remote'}", {"remote_codec": "zstd"}, [kv_like(1)])
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert "remote codec zstd (zstd)" in result.output
    result = CliRunner().invoke(cli, ["inspect", "--json", str(tmp_path / "a")])
    assert '"codec": "zstd"' in result.output


def test_lookup_can_stay_local(tmp_path: Path) -> None:
    """``lookup(remote=False)`` answers from the local tier alone (the
    connector's cost model skips a remote slower than recompute)."""
    remote = f"file://{tmp_path / 'remote'}"
    keys = put_and_upload(tmp_path / "a", remote, {}, [kv_like(i, 4096) for i in range(4)])
    with ucm_db.open(tmp_path / "b", codec="none", capacity_bytes=1 << 30, remote=remote) as fresh:
        assert fresh.lookup(NS, keys, remote=False) == 0
        assert fresh.lookup(NS, keys) == 4
        assert fresh.lookup(NS, keys, remote=False) == 4  # promoted by the full lookup
