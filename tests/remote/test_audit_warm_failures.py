"""A warm that meets a failing remote says so (audit: one transient error
while fetching one chain opened the read breaker, and every chain warmed in
its backoff asked nothing and was counted ``missing``, as if the remote did
not hold it: 1 injected error turned 56 of 60 fetchable blocks into
"missing", and ``ucm-db warm`` exited 0; an error on a chain's first probe
instead raised, losing the report of what was warmed).

Now blocks not fetched because the remote failed are counted ``failed``
(never ``missing``), a later chain waits out the breaker's backoff and is
fetched, nothing wrong lands locally, and ``ucm-db warm`` exits 1 with the
report. Node A writes through a real LMDB store to a real ``file://``
directory; node B warms from it through a wrapper that fails the reads of
one object's path (``ucmaudflaky://``, see test_audit_gc_read_errors.py): a
transient error on one chosen object, which the real remotes of the tests
cannot be made to produce.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import ucm_db
from ucm_db.components import remote_link
from ucm_db.keys import Namespace
from ucm_db.tools.cli import cli

from .test_audit_gc_read_errors import FlakyPathFileSystem  # noqa: F401 - registers ucmaudflaky://

pytestmark = pytest.mark.timeout(120)
NS = Namespace(model="test/audit-warm-failures", kv_dtype="bfloat16", block_size=4, layout="test")
CHAINS = 10
BLOCKS = 6
PROMPTS = [list(range(1000 * i + 1, 1000 * i + 1 + 4 * BLOCKS)) for i in range(CHAINS)]


def payload(chain: int, block: int) -> bytes:
    return bytes([chain, block]) * 200


def written(tmp_path: Path) -> tuple[Path, list[list[bytes]]]:
    remote = tmp_path / "remote"
    remote.mkdir()
    chains = [NS.block_keys(p) for p in PROMPTS]
    with ucm_db.open(tmp_path / "a", capacity_bytes=64 << 20, remote=f"file://{remote}", remote_mode="write_through") as a:
        for c, keys in enumerate(chains):
            a.put(NS, keys, [payload(c, b) for b in range(BLOCKS)])
    return remote, chains


def flaky_store(tmp_path: Path, remote: Path, key: bytes | None, fail_reads: int) -> ucm_db.Store:
    options = {"target_protocol": "file", "fail_suffix": "*" if key is None else key.hex(), "fail_reads": fail_reads}
    return ucm_db.open(tmp_path / "b", capacity_bytes=64 << 20, remote=f"ucmaudflaky://{remote}", remote_options=options)


def served(path: Path, chains: list[list[bytes]]) -> int:
    """Blocks the store at ``path`` holds (opened without its remote), each
    checked against what node A stored."""
    n = 0
    with ucm_db.open(path) as store:
        for c, keys in enumerate(chains):
            for b, got in enumerate(store.get(NS, keys)):
                if got is not None:
                    assert bytes(got) == payload(c, b)
                    n += 1
    return n


@pytest.mark.parametrize("at_block", [2, 0], ids=["mid-chain", "first-block"])
def test_one_transient_error_is_counted_failed_and_the_other_chains_warm(tmp_path: Path, at_block: int) -> None:
    remote, chains = written(tmp_path)
    with flaky_store(tmp_path, remote, chains[1][at_block], fail_reads=1) as b:
        report = b.warm(NS, token_sequences=PROMPTS)
        lost = BLOCKS - at_block
        assert (report.fetched, report.missing, report.failed) == (CHAINS * BLOCKS - lost, 0, lost), report
        assert report.blocks == CHAINS * BLOCKS
    assert served(tmp_path / "b", chains) == CHAINS * BLOCKS - lost
    with flaky_store(tmp_path, remote, None, fail_reads=0) as b:  # the remote answers again: a rerun fetches the rest
        again = b.warm(NS, token_sequences=PROMPTS)
        assert (again.already_local, again.fetched, again.missing, again.failed) == (CHAINS * BLOCKS - lost, lost, 0, 0)
    assert served(tmp_path / "b", chains) == CHAINS * BLOCKS


def test_a_chain_the_remote_lacks_is_missing_not_failed(tmp_path: Path) -> None:
    remote, chains = written(tmp_path)
    with flaky_store(tmp_path, remote, b"\0" * 32, fail_reads=0) as b:
        report = b.warm(NS, token_sequences=PROMPTS[:2] + [list(range(90000, 90000 + 4 * BLOCKS))])
        assert (report.fetched, report.missing, report.failed) == (2 * BLOCKS, BLOCKS, 0)


def test_a_remote_that_keeps_failing_ends_the_warm_after_a_few_chains_all_counted_failed(tmp_path: Path) -> None:
    remote, chains = written(tmp_path)
    with flaky_store(tmp_path, remote, None, fail_reads=-1) as b:  # every object read fails from here on
        report = b.warm(NS, token_sequences=PROMPTS)
        assert (report.fetched, report.missing, report.failed) == (0, 0, CHAINS * BLOCKS), report
        fs = remote_link(b).root.fs  # type: ignore[union-attr]
        assert fs.failed <= 3 * BLOCKS, fs.failed  # warming.FAILED_CHAINS_LIMIT chains tried, the other 7 asked nothing
    assert served(tmp_path / "b", chains) == 0


def test_the_cli_warm_exits_1_and_reports_failed_blocks(tmp_path: Path) -> None:
    remote, chains = written(tmp_path)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    result = CliRunner().invoke(cli, [
        "warm", str(tmp_path / "b"), "--remote", f"ucmaudflaky://{remote}", "--namespace", NS.model,
        "--tokens", str(tmp_path / "prompts.jsonl"), "--json", "--option", "target_protocol=file",
        "--option", f"fail_suffix={chains[3][4].hex()}", "--option", "fail_reads=1"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert (report["fetched"], report["missing"], report["failed"]) == (CHAINS * BLOCKS - 2, 0, 2), report


def test_the_cli_warm_of_an_unreachable_remote_names_it_and_a_warm_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A remote nothing listens on (a closed port on 127.0.0.1): exit 1 naming
    the failure, with a hint for warm (it said "blocks stay queued locally
    and are retried", of uploads, which a warm has none of)."""
    from .conftest import _free_port

    (tmp_path / "prompts.jsonl").write_text(json.dumps(PROMPTS[0]) + "\n")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries of a refused connection: seconds, not what is tested
    result = CliRunner().invoke(cli, [
        "warm", str(tmp_path / "b"), "--remote", "s3://nowhere/kv", "--namespace", NS.model, "--tokens",
        str(tmp_path / "prompts.jsonl"), "--json", "--option", f"endpoint_url=http://127.0.0.1:{_free_port()}",
        "--option", "key=k", "--option", "secret=s"])
    assert result.exit_code == 1, result.output
    error = json.loads(result.stdout)["error"]
    assert "s3://nowhere/kv" in error["message"] and "EndpointConnectionError" in error["message"]
    assert "queued" not in error["hint"] and "endpoint_url" in error["hint"]


def test_a_key_chain_whose_first_probe_fails_is_counted_failed(tmp_path: Path) -> None:
    """A chain given by keys that starts mid-chain is probed first (is its
    first block's parent local?): a failure there is ``failed`` too (it used
    to raise a TierError, losing the report of the chains before it)."""
    remote, chains = written(tmp_path)
    with flaky_store(tmp_path, remote, chains[1][2], fail_reads=1) as b:
        first = b.warm(NS, keys=[chains[0], chains[1][:2]])
        assert (first.fetched, first.failed) == (BLOCKS + 2, 0)
        report = b.warm(NS, keys=[chains[1][2:], chains[2]])
        assert (report.fetched, report.missing, report.failed) == (BLOCKS, 0, BLOCKS - 2), report


def test_a_prompt_chain_is_fetched_without_a_probe_first(tmp_path: Path) -> None:
    """A prompt's chain starts at a chain root (its first block has no
    parent), so warming it asks only for its blocks: it also probed each
    prompt's first block, one sequential round trip per prompt (8.3 s for
    200 two-block prompts over a link adding 20 ms a request, 4.2 s without)."""
    remote, _chains = written(tmp_path)
    with flaky_store(tmp_path, remote, None, fail_reads=0) as b:
        b.epoch(NS)  # first contact (the manifest) before counting
        before = b.stats().remote["requests"]
        assert b.warm(NS, token_sequences=PROMPTS).fetched == CHAINS * BLOCKS
        assert b.stats().remote["requests"] - before == CHAINS * BLOCKS  # before: + one probe per prompt
