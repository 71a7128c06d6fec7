"""Prefill/decode engine jobs: one offline vLLM CPU engine with the ucm-db
connector in a ``kv_role``, in its own process (``ucm-db bench pd`` and the
PD tests in tests/vllm, which import it through ``pd_helpers``).

    python -m ucm_db.tools.bench.pd_engine SPEC.json RESULT.json

runs :func:`run_job` on the spec (``spec["role"]``):

* ``kv_producer``: each prompt with ``max_tokens=1`` (what the PD proxy
  sends prefill), appending ``{"i": i, "params": kv_transfer_params}`` to
  ``spec["params_out"]`` (JSON lines) as soon as its ``generate`` returns,
  then counts the files of its remote (``remote_files``). Before that,
  unless ``spec["reference"]`` is false, it runs every prompt with
  ``max_tokens`` under a salt of its own (keys no hit can match: a
  recomputation, the reference outputs).
* ``kv_consumer``: starts its engine at once, then for each prompt waits for
  its line in ``spec["params_in"]`` and generates ``max_tokens`` with those
  params, so a read-after-write gap between the two processes shows as a
  short hit. With ``spec["compare_recompute"]`` it then computes the same
  prompt whole under a salt (``recompute_latency_s``).

``spec["enforce_eager"]`` (default false) runs the engine without
torch.compile: a faster start, for the tests.

RESULT: {"outputs": [[ids]], "cached": [num_cached_tokens], "params": [...],
"latency_s": [...], "remote_files": int (producers), "reference": [[ids]],
"publish_wait_s", "save_copy_s", "save_commit_s": [...] (producers with ``spec["stats"]``)}.

Invariants:
    * ``publish_wait_s`` (with ``spec["stats"]``) is, per request, the
      increase of the connector's ``ucm_db_publish_wait_seconds`` counter
      over its ``generate`` call, read from vLLM's in-process Prometheus
      registry. vLLM ships a step's connector stats
      with that step's outputs, so the counter holds every step of the
      request when ``generate`` returns.
    * A job's output goes to a log file, never a pipe (an engine writing to
      a pipe nobody reads can hang); :meth:`JobProcess.kill` takes the whole
      process group (EngineCore and workers) down.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import click

from ucm_db.tools.bench.serve_server import CONNECTOR, transfer_config  # noqa: F401 - CONNECTOR re-exported for the PD tests

BLOCK_SIZE = 32
#: TP=2 on a 2-core machine: one core per rank.
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
#: The producer's in-step commit (and upload) wait, as vLLM's snapshot names it.
PUBLISH_WAIT_METRIC = "vllm:ucm_db_publish_wait_seconds"
#: Per-request counters a producer records with ``spec["stats"]`` (result key -> metric).
SAVE_METRICS = {"publish_wait_s": PUBLISH_WAIT_METRIC, "save_copy_s": "vllm:ucm_db_save_copy_seconds",
                "save_commit_s": "vllm:ucm_db_save_commit_seconds"}


# -- the engine job (runs in the child) ---------------------------------------------
def _engine(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(
        model=spec["model"], skip_tokenizer_init=True, dtype=spec.get("dtype", "bfloat16"), block_size=BLOCK_SIZE,
        max_model_len=spec.get("max_model_len", 2048), max_num_seqs=8, enable_prefix_caching=False, seed=0,
        tensor_parallel_size=spec.get("tp", 1), enforce_eager=spec.get("enforce_eager", False),
        disable_log_stats=not spec.get("stats", False),
        kv_transfer_config=transfer_config(spec["role"], spec["connector"]),
    )


def _generate(llm: Any, ids: list[int], max_tokens: int, params: dict[str, Any] | None = None, salt: str | None = None) -> Any:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=ids)
    if salt:
        prompt["cache_salt"] = salt
    extra = {"kv_transfer_params": params} if params is not None else None
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
    return llm.generate([prompt], sampling, use_tqdm=False)[0]


def publish_wait_total_s(registry: Any = None, metric: str = PUBLISH_WAIT_METRIC) -> float:
    """The producer's publication wait so far (or another counter of the
    connector's), summed over engines, from the Prometheus registry (vLLM's
    ``LLM.get_metrics`` rounds counters down to whole numbers, seconds
    included); 0.0 before the counter exists."""
    if registry is None:
        from prometheus_client import REGISTRY as registry
    total = 0.0
    for family in registry.collect():
        if family.name == metric:
            total += sum(float(s.value) for s in family.samples if s.name.endswith("_total"))
    return total


def _save_counters_s() -> dict[str, float]:
    """What the producer's step waited for (publish), and its parts: the copy out and the writer's encode + commit."""
    return {key: publish_wait_total_s(metric=name) for key, name in SAVE_METRICS.items()}


def remote_files(url: str | None) -> int:
    """Files under a ``file://`` remote tier (0 without one)."""
    if not url:
        return 0
    return sum(1 for p in Path(url.removeprefix("file://")).rglob("*") if p.is_file())


def _wait_line(path: Path, index: int, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text().splitlines():
                if line.endswith("}"):
                    entry = json.loads(line)
                    if entry["i"] == index:
                        return entry  # type: ignore[no-any-return]
        time.sleep(0.005)
    raise TimeoutError(f"no params for prompt {index} in {path} after {timeout_s}s")


def _produce(llm: Any, spec: dict[str, Any], i: int, ids: list[int], result: dict[str, Any]) -> Any:
    before = _save_counters_s() if spec.get("stats") else {}
    started = time.perf_counter()
    out = _generate(llm, ids, 1)
    result["latency_s"].append(time.perf_counter() - started)
    for key, value in _save_counters_s().items() if spec.get("stats") else ():
        result.setdefault(key, []).append(value - before[key])
    with open(spec["params_out"], "a") as handle:
        handle.write(json.dumps({"i": i, "params": out.kv_transfer_params}) + "\n")
    result["params"].append(out.kv_transfer_params)
    return out


def _consume(llm: Any, spec: dict[str, Any], i: int, ids: list[int], result: dict[str, Any]) -> Any:
    params = _wait_line(Path(spec["params_in"]), i, spec.get("wait_s", 600))["params"]
    started = time.perf_counter()
    out = _generate(llm, ids, spec["max_tokens"], params)
    result["latency_s"].append(time.perf_counter() - started)
    result["params"].append(params)
    if spec.get("compare_recompute"):  # the same request computed whole here (the figure's baseline)
        started = time.perf_counter()
        _generate(llm, ids, spec["max_tokens"], salt=f"recompute-{i}")
        result.setdefault("recompute_latency_s", []).append(time.perf_counter() - started)
    return out


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine in ``spec["role"]`` over ``spec["prompts"]`` (see the module docstring)."""
    llm = _engine(spec)
    result: dict[str, Any] = {"outputs": [], "cached": [], "params": [], "latency_s": [], "reference": [],
                              "publish_wait_s": []}
    producer = spec["role"] == "kv_producer"
    try:
        if producer and spec.get("reference", True):
            # First, so that every write of the producer precedes remote_files.
            for ids in spec["prompts"]:
                result["reference"].append(list(_generate(llm, ids, spec["max_tokens"], salt="reference").outputs[0].token_ids))
        for i, ids in enumerate(spec["prompts"]):
            out = _produce(llm, spec, i, ids, result) if producer else _consume(llm, spec, i, ids, result)
            result["outputs"].append(list(out.outputs[0].token_ids))
            result["cached"].append(int(out.num_cached_tokens or 0))
        if producer:
            result["remote_files"] = remote_files(spec["connector"].get("remote"))
    finally:
        llm.llm_engine.engine_core.shutdown()
    return result


# -- the parent's side ----------------------------------------------------------------
#: What every job's environment adds to the parent's (before ``spec["env"]``).
JOB_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}


class StartedJob(Protocol):
    """What :class:`JobProcess` uses of a started job (``subprocess.Popen`` has it)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


#: Starts ``python *args`` with output to the log path and that whole
#: environment, leading a new process group (:meth:`JobProcess.kill` takes
#: the group down).
Launch = Callable[[list[str], Path, dict[str, str]], StartedJob]


def popen_launch(args: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """The default :data:`Launch`: a new interpreter."""
    with log_path.open("wb") as log:
        return subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)


@dataclass
class JobProcess:
    """A running engine job; :meth:`wait` returns its result with its log."""

    proc: StartedJob
    result_path: Path
    log_path: Path

    def wait(self, timeout_s: float = 600) -> dict[str, Any]:
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        log = self.log_path.read_text(errors="replace")
        if rc != 0:
            raise AssertionError(f"{self.log_path.name}: engine job failed (rc={rc}); log tail:\n{log[-4000:]}")
        result: dict[str, Any] = json.loads(self.result_path.read_text())
        result["log"] = log
        return result

    def kill(self) -> None:
        """SIGKILL to the job's process group: its EngineCore and workers too."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def start_job(spec: dict[str, Any], work_dir: Path, name: str, launch: Launch = popen_launch) -> JobProcess:
    """Starts :func:`run_job` on ``spec`` through ``launch`` (``python -m`` this
    module); :data:`JOB_ENV`, then ``spec["env"]``, add to its environment."""
    spec_path = work_dir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    result_path, log_path = work_dir / f"{name}.result.json", work_dir / f"{name}.log"
    env = {**os.environ, **JOB_ENV, **spec.get("env", {})}
    proc = launch(["-m", __name__, str(spec_path), str(result_path)], log_path, env)
    return JobProcess(proc, result_path, log_path)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("spec_path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("result_path", type=click.Path(dir_okay=False, path_type=Path))
def main(spec_path: Path, result_path: Path) -> None:
    """The child's side: reads SPEC_PATH, runs the engine job, writes RESULT_PATH (JSON)."""
    result = run_job(json.loads(spec_path.read_text()))
    result_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
