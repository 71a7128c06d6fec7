"""A read through the remote never fails on blocks that do not fit the local
tier (audit F4): pinned blocks, the prompt's own local prefix (protected:
the promoted run continues it) and the promoted run together exceed the
capacity. The put inside promotion raises ``StoreFullError``; before the
fix it escaped ``Store.lookup`` and ``Store.get``, and the connector's
inline lookup let it reach vLLM's scheduler, killing the engine core.

Now, as for a run that would continue another namespace's chain, nothing
of the run is promoted: a lookup reports the local prefix only, a ``get``
serves what it fetched without keeping it.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

import ucm_db
from ucm_db import Namespace

from .conftest import Remote

CAP = 4 << 20
BLOCK_BYTES = 64 << 10
PINNED = 30  # ~1.9 MiB of the 2 MiB that max_pinned_bytes allows by default
PROMPT = 40
LOCAL = 24  # pinned + local fit (~3.4 MiB); adding the other 16 does not


def _payloads(n: int) -> list[bytes]:
    return [os.urandom(BLOCK_BYTES) for _ in range(n)]


def _prompts(namespace: Namespace) -> tuple[list[bytes], list[bytes]]:
    rng = random.Random(4)
    system = namespace.block_keys([rng.randrange(50_000) for _ in range(PINNED * namespace.block_size)])
    prompt = namespace.block_keys([rng.randrange(50_000) for _ in range(PROMPT * namespace.block_size)])
    return system, prompt


def _node_with_pins_and_prefix(
    remote: Remote, tmp_path: Path, name: str, namespace: Namespace, system: list[bytes], prompt: list[bytes],
    payloads: list[bytes],
) -> ucm_db.Store:
    """A small node holding a pinned system prompt and the first LOCAL blocks of ``prompt``."""
    store = ucm_db.open(tmp_path / name, capacity_bytes=CAP, codec="none", **remote.store_options(remote_deadline_s=10))
    store.put(namespace, system, _payloads(PINNED))
    store.pin(namespace, system)
    store.put(namespace, prompt[:LOCAL], payloads[:LOCAL])
    return store


@pytest.fixture
def uploaded(remote: Remote, tmp_path: Path, namespace: Namespace) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """A bigger node put the whole prompt through to the remote."""
    system, prompt = _prompts(namespace)
    payloads = _payloads(PROMPT)
    with ucm_db.open(tmp_path / "big", capacity_bytes=64 << 20, codec="none", remote_mode="write_through",
                     **remote.store_options()) as big:
        big.put(namespace, prompt, payloads)
    return system, prompt, payloads


@pytest.mark.parametrize("remote", ["memory", "file"], indirect=True)
def test_lookup_that_cannot_keep_the_remote_run_returns_the_local_prefix(
    remote: Remote, tmp_path: Path, namespace: Namespace, uploaded: tuple[list[bytes], list[bytes], list[bytes]],
) -> None:
    system, prompt, payloads = uploaded
    with _node_with_pins_and_prefix(remote, tmp_path, "b", namespace, system, prompt, payloads) as store:
        # The remote holds blocks LOCAL.. too, but they cannot be kept: not an error, a shorter prefix.
        assert store.lookup(namespace, prompt) == LOCAL
        assert store.lookup(namespace, prompt, remote=False) == LOCAL
        assert store.lookup(namespace, system, remote=False) == PINNED, "pins untouched"
        assert store.stats().blocks == PINNED + LOCAL
        assert store._tier.check() == []


@pytest.mark.parametrize("remote", ["memory", "file"], indirect=True)
def test_get_serves_the_remote_blocks_it_cannot_keep(
    remote: Remote, tmp_path: Path, namespace: Namespace, uploaded: tuple[list[bytes], list[bytes], list[bytes]],
) -> None:
    system, prompt, payloads = uploaded
    with _node_with_pins_and_prefix(remote, tmp_path, "b", namespace, system, prompt, payloads) as store:
        got = store.get(namespace, prompt)  # no lookup first: the get meets the full store itself
        assert [None if g is None else bytes(g) for g in got] == payloads, "served from the remote"
        assert store.lookup(namespace, prompt, remote=False) == LOCAL, "not kept locally"
        assert store.stats().blocks == PINNED + LOCAL
        assert store._tier.check() == []
