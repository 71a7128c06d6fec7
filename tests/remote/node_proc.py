"""A "node" process for the two-node and crash tests (run by path).

Usage: ``python tests/remote/node_proc.py '<json spec>'`` with keys
``store``, ``remote``, ``remote_options``, ``namespace``, ``n_blocks``,
``seed``, ``batch_blocks``, ``upload_concurrency``, ``flush`` (bool),
``then`` (``"exit"`` or ``"sleep"``) and ``options`` (more store options,
e.g. key settings). It puts one deterministic chain,
prints ``PUT-DONE``, optionally flushes (``FLUSHED``), then exits or sleeps
until killed.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any


def chain(namespace: Any, n_blocks: int, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    """Keys and distinct, partly compressible payloads of one chain."""
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(n_blocks * namespace.block_size)]
    keys = namespace.block_keys(tokens)
    payloads = [rng.randbytes(512) + bytes(1536) + key for key in keys]
    return keys, payloads


def main(spec: dict[str, Any]) -> None:
    import ucm_db

    if spec["remote"].startswith("ucmfault://"):  # the tests' fault wrapper: registered by whoever uses it
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import faultfs

        faultfs.register()

    namespace = ucm_db.Namespace.from_dict(spec["namespace"])
    keys, payloads = chain(namespace, spec["n_blocks"], spec.get("seed", 0))
    store = ucm_db.open(
        spec["store"], capacity_bytes=256 << 20, remote=spec["remote"],
        remote_options=spec.get("remote_options", {}), upload_concurrency=spec.get("upload_concurrency", 4),
        **spec.get("options", {}),
    )
    step = spec.get("batch_blocks", len(keys))
    for at in range(0, len(keys), step):
        store.put(namespace, keys[at : at + step], payloads[at : at + step], parent=keys[at - 1] if at else None)
    print("PUT-DONE", flush=True)
    if spec.get("flush"):
        store.flush(upload_timeout_s=60)
        print("FLUSHED", flush=True)
    if spec.get("then") == "sleep":
        time.sleep(3600)
    store.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
