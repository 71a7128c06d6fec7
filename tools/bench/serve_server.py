"""vLLM's OpenAI server on CPU for the serving benchmark: start, wait until
healthy, stop; and vLLM's own load generator (``vllm bench serve``) against it.

Invariants:
    * The server is ``python -m vllm.entrypoints.openai.api_server`` in its
      own process group, output to a log file (a pipe nobody reads can hang
      an engine); :meth:`Server.stop` sends SIGINT to the group, then
      SIGKILL after a grace period, so no EngineCore outlives a row.
    * ``VLLM_CPU_NUM_OF_RESERVED_CPU`` is pinned: with a KV connector vLLM-CPU
      otherwise gives the model another number of cores than without one
      (docs/vllm-cpu-connector-effect.md), and rows would measure that.
    * The load generator runs in a new process through
      :mod:`ucm_db.tools.bench.serve_loadgen` (vllm-cpu's ``vllm`` script
      cannot find its own distribution); its result is the JSON file that
      ``--save-result`` writes, never parsed from its log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from ucm_db.tools.bench.cpu_dtype import fast_dtype

BLOCK_SIZE = 32
#: 1 is vLLM's own layout here without a connector: one core for the model,
#: one for the engine core (see the module invariants).
RESERVED_CPUS = 1


#: The ucm-db connector in vLLM's ``kv_transfer_config``, less role and options.
CONNECTOR = {"kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector", "kv_load_failure_policy": "recompute"}
#: The model name every benchmark server answers to.
SERVED_NAME = "bench"


def transfer_config(role: str, extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for ucm-db in ``role`` with connector options ``extra``."""
    return {**CONNECTOR, "kv_role": role, "kv_connector_extra_config": extra}


class ProcessSpec(Protocol):
    """What :class:`Server` starts: a command line for a port, and extra environment."""

    @property
    def env(self) -> dict[str, str]: ...

    def argv(self, port: int) -> list[str]: ...


@dataclass(frozen=True)
class ServerSpec:
    """One OpenAI server: the model, its KV cache cap (None: vLLM's own
    sizing) and the connector (None: without one) in ``role``."""

    model: Path
    num_blocks: int | None
    max_model_len: int
    connector: dict[str, Any] | None = None
    enforce_eager: bool = False
    env: dict[str, str] = field(default_factory=dict)
    role: str = "kv_both"
    dtype: str = field(default_factory=lambda: fast_dtype().dtype)  # the dtype this CPU serves fast (cpu_dtype.py)
    #: Another connector's whole ``kv_transfer_config`` (``connector`` is then None): the no-op baseline.
    transfer: dict[str, Any] | None = None

    def argv(self, port: int) -> list[str]:
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--served-model-name", SERVED_NAME, "--dtype", self.dtype, "--block-size", str(BLOCK_SIZE),
            "--max-model-len", str(self.max_model_len), "--max-num-seqs", "8", "--seed", "0",
            "--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
        ]
        if self.num_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.num_blocks)]
        if self.enforce_eager:
            args.append("--enforce-eager")  # no torch.compile: minutes less per start on a loaded host
        if self.connector is not None:
            args += ["--kv-transfer-config", json.dumps(transfer_config(self.role, self.connector))]
        elif self.transfer is not None:
            args += ["--kv-transfer-config", json.dumps(self.transfer)]
        return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: A connector that does nothing (tools/bench/noop_connector.py): a server
#: with it pays vLLM's connector plumbing and nothing else.
NOOP_TRANSFER = {"kv_connector": "NoopConnector", "kv_connector_module_path": "ucm_db.tools.bench.noop_connector",
                 "kv_role": "kv_both"}
#: The environment variable that gives the bound rows' servers a connector:
#: unset or ``none``, none (the bound a user compares against); ``noop``,
#: :data:`NOOP_TRANSFER`, so ucm-db's rows over those bounds show ucm-db's
#: own cost apart from vLLM's connector plumbing.
BOUND_CONNECTOR_ENV = "UCM_DB_BENCH_BOUND_CONNECTOR"


def bound_connector() -> str:
    """``none`` or ``noop``: the bound rows' connector, as
    :data:`BOUND_CONNECTOR_ENV` names it.

    Raises:
        ValueError: the variable names another connector.
    """
    wanted = os.environ.get(BOUND_CONNECTOR_ENV, "none") or "none"
    if wanted not in ("none", "noop"):
        raise ValueError(f"{BOUND_CONNECTOR_ENV}={wanted!r}: want none (no connector) or noop (vLLM's plumbing alone)")
    return wanted


def bound_note(connector: str) -> str:
    """What a report's header adds for the bound rows' ``connector``."""
    return "" if connector == "none" else "; the bound rows with vLLM's no-op connector (its plumbing alone)"


def bound_spec(capped: ServerSpec, bound_blocks: int) -> ServerSpec:
    """The bound rows' server: ``capped`` with ``bound_blocks`` of KV
    cache and the connector :func:`bound_connector` names."""
    noop = bound_connector() == "noop"
    return replace(capped, num_blocks=bound_blocks, connector=None, transfer=NOOP_TRANSFER if noop else None)


class Server:
    """A running OpenAI server (use as a context manager)."""

    def __init__(self, spec: ProcessSpec, log_path: Path, *, start_timeout_s: float = 420.0) -> None:
        self.spec = spec
        self.port = free_port()
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self.start_s = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pgid(self) -> int:
        """The server's process group (it leads its own session), or -1
        before it starts."""
        return -1 if self._proc is None else self._proc.pid

    def __enter__(self) -> Server:
        env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_CPU_NUM_OF_RESERVED_CPU=str(RESERVED_CPUS),
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), PYTHONUNBUFFERED="1",
                   **self.spec.env)
        started = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(self.spec.argv(self.port), stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - started
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def connector_counters(self) -> dict[str, float]:
        """The ucm-db counters on the server's ``/metrics`` now (empty
        without a connector): see :func:`parse_connector_counters`."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as response:
            return parse_connector_counters(response.read().decode("utf-8", errors="replace"))

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited {self._proc.returncode} during start; log {self.log_path}:\n"
                                   + self.log_path.read_text(errors="replace")[-3000:])
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM server not healthy after {self.start_timeout_s:.0f} s; log {self.log_path}")

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGINT to the server's process group, SIGKILL if it lingers."""
        if self._proc is None or self._proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self._proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # The group may hold an EngineCore whose parent is gone: take it down too.
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


#: Prometheus names of the connector's counters (connector/metrics.py).
_COUNTER_PREFIX, _COUNTER_SUFFIX = "vllm:ucm_db_", "_total"


def parse_connector_counters(text: str) -> dict[str, float]:
    """ucm-db's counters in a Prometheus text page, summed over their
    labels (engines): ``{"hit_tokens": ..., "cost_skips": ...}``. Lines of
    other metrics, comments and ``_created`` samples are ignored."""
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(_COUNTER_PREFIX):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0][len(_COUNTER_PREFIX):]
        if not name.endswith(_COUNTER_SUFFIX):
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        key = name[:-len(_COUNTER_SUFFIX)]
        counters[key] = counters.get(key, 0.0) + number
    return counters


@dataclass(frozen=True)
class LoadSpec:
    """What ``vllm bench serve`` sends (``prefix_repetition``: shared prefixes, own suffixes)."""

    num_prompts: int = 128
    num_prefixes: int = 16
    prefix_len: int = 2048
    suffix_len: int = 64
    output_len: int = 16
    concurrency: int = 4
    seed: int = 7

    @property
    def request_tokens(self) -> int:
        return self.prefix_len + self.suffix_len + self.output_len

    def argv(self, server: Server, model: Path, result_dir: Path, result_name: str) -> list[str]:
        return [
            sys.executable, "-m", "ucm_db.tools.bench.serve_loadgen", "bench", "serve", "--backend", "vllm",
            "--base-url", server.base_url, "--model", "bench", "--tokenizer", str(model),
            "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(self.prefix_len),
            "--prefix-repetition-suffix-len", str(self.suffix_len),
            "--prefix-repetition-num-prefixes", str(self.num_prefixes),
            "--prefix-repetition-output-len", str(self.output_len), "--num-prompts", str(self.num_prompts),
            "--max-concurrency", str(self.concurrency), "--seed", str(self.seed), "--ignore-eos",
            "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", result_name,
        ]


def run_load(load: LoadSpec, server: Server, model: Path, result_dir: Path, name: str,
             timeout_s: float = 1800.0) -> dict[str, Any]:
    """One pass of ``vllm bench serve``; returns its saved result document."""
    result_path = result_dir / f"{name}.json"
    log_path = result_dir / f"{name}.loadgen.log"
    with open(log_path, "wb") as log:
        done = subprocess.run(load.argv(server, model, result_dir, result_path.name), stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout_s,
                              env=dict(os.environ, VLLM_HOST_IP="127.0.0.1"))
    if done.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"vllm bench serve exited {done.returncode}; log {log_path}:\n"
                           + log_path.read_text(errors="replace")[-3000:])
    result: dict[str, Any] = json.loads(result_path.read_text())
    if result.get("completed") != load.num_prompts:
        raise RuntimeError(f"{name}: {result.get('completed')} of {load.num_prompts} requests completed "
                           f"({result.get('failed')} failed); log {log_path}")
    return result
