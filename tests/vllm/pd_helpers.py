"""Helpers of the prefill/decode tests (issue 11), and the engine job they run.

    python pd_helpers.py SPEC.json RESULT.json
    python pd_helpers.py ttft WORK_DIR     (the TTFT figure: :func:`measure_ttft`)

runs one offline vLLM CPU engine in its own process with the connector in
``spec["role"]``:

* ``kv_producer``: each prompt with ``max_tokens=1`` (what the PD proxy
  sends prefill), appending ``{"i": i, "params": kv_transfer_params}`` to
  ``spec["params_out"]`` (JSON lines) as soon as its ``generate`` returns,
  then records the store's block count (``blocks_after_publish``). Before
  that it runs every prompt with ``max_tokens`` under a salt of its own
  (keys no hit can match: a recomputation, the reference outputs).
* ``kv_consumer``: starts its engine at once, then for each prompt waits for
  its line in ``spec["params_in"]`` and generates ``max_tokens`` with those
  params, so a read-after-write gap between the two processes shows as a
  short hit.

RESULT: {"outputs": [[ids]], "cached": [num_cached_tokens], "params": [...],
"latency_s": [...], "blocks_after_publish": int | None, "reference": [[ids]]}.

Also the HTTP side: :func:`build_text_model` (a tiny model with a locally
trained tokenizer and chat template), :class:`ServerProcess` (one
``python -m vllm.entrypoints.openai.api_server`` or proxy, output to a file,
stopped with SIGINT to its process group).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 32
CONNECTOR = {"kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector", "kv_load_failure_policy": "recompute"}
#: TP=2 on a 2-core machine: one core per rank.
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def transfer_config(role: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {**CONNECTOR, "kv_role": role, "kv_connector_extra_config": extra}


# -- the offline engine job ----------------------------------------------------------
def _engine(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(
        model=spec["model"], skip_tokenizer_init=True, dtype=spec.get("dtype", "bfloat16"), block_size=BLOCK_SIZE,
        max_model_len=spec.get("max_model_len", 2048), max_num_seqs=8, enable_prefix_caching=False, seed=0, tensor_parallel_size=spec.get("tp", 1),
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


def _store_blocks(path: str) -> int:
    import ucm_db

    with ucm_db.open(path) as store:
        return int(store.stats().blocks)


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
                        return entry
        time.sleep(0.005)
    raise TimeoutError(f"no params for prompt {index} in {path} after {timeout_s}s")


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    llm = _engine(spec)
    result: dict[str, Any] = {"outputs": [], "cached": [], "params": [], "latency_s": [], "blocks_after_publish": None, "reference": []}
    try:
        if spec["role"] == "kv_producer" and spec.get("reference", True):
            # First, so that every write of the producer precedes blocks_after_publish.
            for ids in spec["prompts"]:
                result["reference"].append(list(_generate(llm, ids, spec["max_tokens"], salt="reference").outputs[0].token_ids))
        for i, ids in enumerate(spec["prompts"]):
            if spec["role"] == "kv_producer":
                started = time.perf_counter()
                out = _generate(llm, ids, 1)
                result["latency_s"].append(time.perf_counter() - started)
                with open(spec["params_out"], "a") as handle:
                    handle.write(json.dumps({"i": i, "params": out.kv_transfer_params}) + "\n")
                result["params"].append(out.kv_transfer_params)
            else:
                params = _wait_line(Path(spec["params_in"]), i, spec.get("wait_s", 600))["params"]
                started = time.perf_counter()
                out = _generate(llm, ids, spec["max_tokens"], params)
                result["latency_s"].append(time.perf_counter() - started)
                result["params"].append(params)
                if spec.get("compare_recompute"):  # the same request computed whole here (figures)
                    started = time.perf_counter()
                    _generate(llm, ids, spec["max_tokens"], salt=f"recompute-{i}")
                    result.setdefault("recompute_latency_s", []).append(time.perf_counter() - started)
            result["outputs"].append(list(out.outputs[0].token_ids))
            result["cached"].append(int(out.num_cached_tokens or 0))
        if spec["role"] == "kv_producer":
            result["blocks_after_publish"] = _store_blocks(spec["connector"]["path"])
            result["remote_files"] = remote_files(spec["connector"].get("remote"))
    finally:
        llm.llm_engine.engine_core.shutdown()
    return result


# -- processes -----------------------------------------------------------------------------
@dataclass
class JobProcess:
    proc: subprocess.Popen[bytes]
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


def start_job(spec: dict[str, Any], work_dir: Path, name: str) -> JobProcess:
    spec_path = work_dir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    result_path, log_path = work_dir / f"{name}.result.json", work_dir / f"{name}.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", **spec.get("env", {})}
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, __file__, str(spec_path), str(result_path)], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    return JobProcess(proc, result_path, log_path)


@dataclass
class ServerProcess:
    """An HTTP server in its own process group, output to ``log_path``."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    @classmethod
    def start(cls, args: list[str], port: int, log_path: Path, env: dict[str, str] | None = None) -> ServerProcess:
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", **(env or {})}
        with log_path.open("wb") as log:
            proc = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=full_env, start_new_session=True)
        return cls(proc, f"http://127.0.0.1:{port}", log_path)

    def wait_healthy(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.log_path.name} exited rc={self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{self.log_path.name} not healthy after {timeout_s}s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL to the whole process group (a crash, not a stop)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout_s: float = 60) -> None:
        """SIGINT to the process group, SIGKILL if it does not exit."""
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


def vllm_server_args(model: Path, port: int, role: str, extra: dict[str, Any], tp: int = 1) -> list[str]:
    return [
        "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny",
        "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048", "--max-num-seqs", "8", "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port), "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
        "--seed", "0", "--tensor-parallel-size", str(tp), "--kv-transfer-config", json.dumps(transfer_config(role, extra)),
    ]


def build_text_model(out_dir: Path, seed: int = 0) -> Path:
    """A 2-layer random-weight float32 Llama with a word-level tokenizer
    trained here and a chat template (no hub access)."""
    if (out_dir / "tokenizer.json").exists():
        return out_dir
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(900)]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    tok.train_from_iterator([" ".join(words)] * 2, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}assistant"
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        vocab_size=1000, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out_dir)
    fast.save_pretrained(out_dir)
    return out_dir


def measure_ttft(root: Path, prompts: int = 5, tokens: int = 2000) -> dict[str, Any]:
    """Consumer-side TTFT (``max_tokens=1``) of disaggregated requests
    against the same requests recomputed on the consumer, one store
    directory, an 8-layer bf16 Llama (hidden 1024, 4 KV heads): the issue-11
    figure. The first request of each kind warms up and is left out."""
    import random
    import statistics

    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    if not (model / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(
            hidden_size=1024, intermediate_size=2730, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
            head_dim=64, vocab_size=8000, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        )).to(torch.bfloat16).save_pretrained(model)
    rng = random.Random(7)
    ids = [[rng.randrange(4, 8000) for _ in range(tokens)] for _ in range(prompts)]
    params = root / "params.jsonl"
    params.unlink(missing_ok=True)
    common = {"model": str(model), "prompts": ids, "max_tokens": 1, "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}
    store = {"path": str(root / "store")}
    producer = start_job({**common, "role": "kv_producer", "reference": False, "params_out": str(params), "connector": store}, root, "producer")
    consumer = start_job({**common, "role": "kv_consumer", "params_in": str(params), "compare_recompute": True, "connector": store}, root, "consumer")
    made, used = producer.wait(3600), consumer.wait(3600)
    load, again = used["latency_s"][1:], used["recompute_latency_s"][1:]
    return {
        "cached_tokens": used["cached"], "consumer_ttft_ms": [round(1e3 * x, 1) for x in used["latency_s"]],
        "recompute_ttft_ms": [round(1e3 * x, 1) for x in used["recompute_latency_s"]],
        "producer_ms": [round(1e3 * x, 1) for x in made["latency_s"]],
        "median_consumer_ms": round(1e3 * statistics.median(load), 1), "median_recompute_ms": round(1e3 * statistics.median(again), 1),
        "ratio": round(statistics.median(load) / statistics.median(again), 3),
    }


def main() -> int:
    if sys.argv[1] == "ttft":  # python tests/vllm/pd_helpers.py ttft WORK_DIR
        print(json.dumps(measure_ttft(Path(sys.argv[2]))))
        return 0
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    result = run_job(spec)
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
