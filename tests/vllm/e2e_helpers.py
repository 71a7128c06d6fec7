"""Helpers for the vLLM end-to-end tests (marker ``vllm``).

Imported by name (``tests/vllm`` is on sys.path under pytest's prepend
import mode; it has no ``__init__.py`` on purpose: a package named ``vllm``
would shadow the real one).

* :func:`build_tiny_model`: a random-weight Llama written with
  ``save_pretrained`` (no hub access); different seeds give different models.
* :func:`start_engine_process` / :meth:`EngineProcess.wait`: one engine in a
  NEW process (``engine_job.py``), output to a log file (an engine writing to
  a pipe nobody reads can hang). The process is a fork of one server that
  imported vLLM once for the session (``engine_forkserver.py``: about 20 s
  of CPU less per engine on a 2-core host); ``UCM_DB_TEST_ENGINE_FORKS=0``
  starts each job as ``python engine_job.py`` instead.
* :func:`in_process_engine`: one engine in the pytest process; always shut
  down with ``llm.llm_engine.engine_core.shutdown()``.
  :func:`one_process_engine`: the same with vLLM's engine core and worker in
  this process too (no vLLM import in new processes); it holds its store open
  in this process, where LMDB allows one open, so a :class:`StoreCounter`
  counts that store from a child process.
  :func:`without_request_proxies`: what lets an engine start in a pytest
  process that loaded flask (the moto tests).
* :func:`reference_engine_kwargs`: what makes an engine a reference: ucm-db
  configured (vLLM-CPU computes slightly different logits with any KV
  connector configured, docs/vllm-cpu-connector-effect.md) as a consumer of
  an empty store, so it loads nothing and saves nothing.
* :func:`wait_for_new_blocks`: the connector commits saves from a background
  thread in the worker process; tests wait for the commit before relying on
  a hit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import ucm_db
from engine_forkserver import ForkedJob, forks_wanted, session_server

HERE = Path(__file__).resolve().parent
ENGINE_JOB = HERE / "engine_job.py"
BLOCK_SIZE = 32

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
# vLLM-CPU 0.32 cannot load its own AOT compile artifacts ("'function' object
# has no attribute 'finalize_loading'"), so with them every compiled engine
# compiles again; without, vLLM's compile cache serves the later ones (an
# engine start about 8 s shorter on a 2-core host). Still compiled engines.
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


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

    proc: subprocess.Popen[bytes] | ForkedJob
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
    """Starts one engine in a new process (see ``engine_job.py`` for ``spec``):
    a fork of the session's fork server unless ``UCM_DB_TEST_ENGINE_FORKS=0``
    or the spec's ``env`` names a variable read at import time."""
    spec_path = work_dir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    result_path, log_path = work_dir / f"{name}.result.json", work_dir / f"{name}.log"
    if forks_wanted(spec.get("env", {})):
        job = session_server().start([str(ENGINE_JOB), str(spec_path), str(result_path)], log_path)
        return EngineProcess(job, result_path, log_path)
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
def without_request_proxies() -> Iterator[None]:
    """Hides, while an in-process engine starts, the modules that hold a
    werkzeug ``LocalProxy`` (flask's ``request``, ``current_app``: imported
    here by moto's S3 server in earlier tests of the same process). vLLM's
    CPU platform scans every module's globals with ``hasattr`` when it starts
    a worker, and such a proxy raises outside a request. Nothing of ucm-db
    is involved; a separate engine process would not see those modules."""
    try:
        from werkzeug.local import LocalProxy
    except ImportError:
        yield
        return
    hidden = {}
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None) or {}
        if any(type(value) is LocalProxy for value in list(namespace.values())):
            hidden[name] = sys.modules.pop(name)
    try:
        yield
    finally:
        sys.modules.update(hidden)


@contextmanager
def one_process_engine(spec: dict[str, Any]) -> Iterator[Any]:
    """:func:`in_process_engine` with vLLM's engine core and worker in this
    process too (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as ``engine_job.py``'s
    ``"processes": "one"``)."""
    with pytest.MonkeyPatch.context() as patch, ExitStack() as stack:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with without_request_proxies():  # only while it starts: its workers scan the modules then
            llm = stack.enter_context(in_process_engine(spec))
        yield llm


_COUNT_LOOP = """
import sys
import ucm_db
for line in sys.stdin:
    with ucm_db.open(line.strip()) as store:
        print(store.stats().blocks, flush=True)
"""


class StoreCounter:
    """Counts a store's blocks in a child process, one open at a time there:
    for a store that an engine in this process holds open."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _COUNT_LOOP], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)

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
                        count_blocks: Callable[[Path], int] = store_blocks, at_least: int | None = None) -> int:
    """Waits until the store holds more than ``before`` blocks (at least
    ``at_least``, where the caller knows how many to expect: a writer that
    pauses longer than ``settle_s`` mid-way is then waited for) and the
    count has not changed for ``settle_s``; returns the count.
    ``count_blocks`` counts them (a :class:`StoreCounter` where this process
    has the store open)."""
    enough = max(before + 1, at_least or 0)
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        count = count_blocks(path)
        if count != last:
            last, since = count, time.monotonic()
        elif count >= enough and time.monotonic() - since >= settle_s:
            return count
        time.sleep(0.1)
    raise AssertionError(f"store at {path} did not grow to {enough} blocks within {timeout_s}s (has {last})")
