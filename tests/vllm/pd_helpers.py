"""Helpers of the prefill/decode tests (issue 11).

The offline engine job (a producer or consumer engine in its own process)
lives with the PD benchmark in :mod:`ucm_db.tools.bench.pd_engine`; its
figures are ``ucm-db bench pd``. :func:`start_job` here starts it as a fork
of the session's preloaded server (``engine_forkserver.py``).

Here too, the HTTP side: :func:`build_text_model` (a tiny model with a locally
trained tokenizer and chat template), :class:`ServerProcess` (one
``python -m vllm.entrypoints.openai.api_server`` or proxy, output to a file,
stopped with SIGINT to its process group; a fork of the session's preloaded
server, ``engine_forkserver.py``, as the engine jobs are).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_forkserver import fork_launch, forks_wanted
from ucm_db.tools.bench import pd_engine
from ucm_db.tools.bench.pd_engine import (  # noqa: F401 - re-exported for the tests
    BLOCK_SIZE, CONNECTOR, TP2_ENV, JobProcess, remote_files, run_job, transfer_config,
)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def random_text(rng: random.Random, words: int) -> str:
    """``words`` tokens of the test tokenizer (one word, one token)."""
    return " ".join(f"w{rng.randrange(900)}" for _ in range(words))


def launcher(env_added: dict[str, str]) -> pd_engine.Launch:
    """How a job whose caller adds ``env_added`` (over ``pd_engine.JOB_ENV``)
    starts: a fork of the session's preloaded server where
    ``engine_forkserver.forks_wanted`` allows, else a new interpreter."""
    return fork_launch if forks_wanted({**pd_engine.JOB_ENV, **env_added}) else pd_engine.popen_launch


def start_job(spec: dict[str, Any], work_dir: Path, name: str) -> JobProcess:
    """``pd_engine.start_job`` (``python -m ucm_db.tools.bench.pd_engine SPEC
    RESULT`` in a new process group) through :func:`launcher`."""
    return pd_engine.start_job(spec, work_dir, name, launcher(spec.get("env", {})))


# -- processes -----------------------------------------------------------------------------
@dataclass
class ServerProcess:
    """An HTTP server in its own process group, output to ``log_path``."""

    proc: pd_engine.StartedJob
    url: str
    log_path: Path

    @classmethod
    def start(cls, args: list[str], port: int, log_path: Path, env: dict[str, str] | None = None) -> ServerProcess:
        """``python *args`` through :func:`launcher`, with ``pd_engine.JOB_ENV`` and ``env`` added."""
        full_env = {**os.environ, **pd_engine.JOB_ENV, **(env or {})}
        return cls(launcher(env or {})(args, log_path, full_env), f"http://127.0.0.1:{port}", log_path)

    def wait_healthy(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (rc := self.proc.poll()) is not None:
                raise AssertionError(f"{self.log_path.name} exited rc={rc}:\n{self.log()[-4000:]}")
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


def vllm_server_args(model: Path, port: int, role: str, extra: dict[str, Any], tp: int = 1,
                     enforce_eager: bool = False) -> list[str]:
    """``enforce_eager`` skips torch.compile (about 20 s less per start on the 2-core machine)."""
    return [
        "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny",
        "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048", "--max-num-seqs", "8", "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port), "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
        "--seed", "0", "--tensor-parallel-size", str(tp), "--kv-transfer-config", json.dumps(transfer_config(role, extra)),
        *(["--enforce-eager"] if enforce_eager else []),
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
