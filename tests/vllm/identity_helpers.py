"""Helpers of ``test_identity_engine.py`` (issue 48's proof), and its job script.

    python identity_helpers.py SPEC.json RESULT.json

runs one vLLM CPU engine (``engine_job.make_engine``: the same engine
arguments) and sends its prompts one by one, as ``engine_job.py`` does, with
two additions: a prompt may name a LoRA adapter (``"lora": [name, id,
path]``), and with ``"start_may_fail": true`` an engine that refuses to
start is a result (``{"start_error": message}``), not a failure. The tests
run it as a fork of the session's fork server (``engine_forkserver.py``), or
as a new process where the spec's ``env`` names a variable read at import
time (the hub cache's).

What it builds, without network:

* :func:`build_llama`: a tiny random-weight Llama written with
  ``save_pretrained`` (float32, 2 layers, head size 64); ``rope`` replaces
  its RoPE parameters. Written again with another seed at the same path,
  the files keep their names and sizes and change their bytes.
* :func:`write_lora`: a PEFT-format LoRA adapter for it (``k_proj``,
  ``v_proj``, ``q_proj``), random: an adapter on ``k_proj``/``v_proj``
  changes every layer's K/V.
* :func:`build_hub_cache`: a Hugging Face hub cache as ``huggingface_hub``
  lays it out (``refs/main``, ``snapshots/<commit>/`` linking to
  ``blobs/<sha256>``), one snapshot per commit.

RESULT: {"outputs": [[token ids]], "cached": [num_cached_tokens],
         "engine_start_s": float, "metrics": {counter: value} (with "metrics": true)}
(or {"start_error": str}); with "steps": [spec, ...] (engines one after another
in this process, each after writing its "write_files": {path: text}) the
result is {"steps": [result, ...]}. The test adds "log" and reads ucm-db's hit
tokens from it (:func:`ucm_db_hits`, per engine :func:`step_logs`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HIT_LINE = re.compile(r"ucm-db: request \S+: (\d+) prompt tokens, (\d+) from vLLM's prefix cache, "
                      r"(\d+) hit tokens loaded from ucm-db")
HEAD_DIM = 64
LAYERS = 2
#: Weights 10x transformers' default spread: attention then peaks, so RoPE,
#: adapters and weights show in the greedy tokens (at 0.02 the attention is
#: near uniform and LongRoPE's short and long factors gave the same tokens).
INIT_RANGE = 0.2


def llama_config(rope: dict[str, Any] | None = None, layers: int = LAYERS) -> Any:
    from transformers import LlamaConfig

    kwargs: dict[str, Any] = {}
    if rope is not None:
        kwargs["rope_parameters"] = rope
    return LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
        head_dim=HEAD_DIM, vocab_size=1000, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, initializer_range=INIT_RANGE, **kwargs,
    )


def build_llama(out_dir: Path, seed: int, rope: dict[str, Any] | None = None) -> Path:
    """Writes a random-weight Llama to ``out_dir`` (over what is there)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(llama_config(rope)).to(torch.float32).save_pretrained(out_dir)
    return out_dir


def _embedding_rows_at_rms_one(model: Any) -> None:
    """Scales each token's embedding to RMS 1: an RMSNorm of weight 1 is then
    the identity on it (a draft head whose input norm is one reads the same)."""
    import torch

    with torch.no_grad():
        rows = model.model.embed_tokens.weight
        rows.copy_(rows / rows.pow(2).mean(-1, keepdim=True).sqrt())


def build_eagle_pair(out_dir: Path) -> tuple[Path, Path]:
    """(a 1-layer random Llama, an EAGLE draft head for it). The head's
    layer is the target's and reads the token embedding alone (``fc`` =
    [I | 0], the target's hidden state ignored), and the target's embedding
    rows have RMS 1 (its input norm is then about the head's identity): the
    head predicts the target's tokens (most drafts accepted) from its own
    KV cache, so drafts over KV it did not compute are rejected."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    target = LlamaForCausalLM(llama_config(layers=1)).to(torch.float32)
    _embedding_rows_at_rms_one(target)
    target.save_pretrained(out_dir / "target")
    head_config = llama_config(layers=1)
    head_config.architectures = ["LlamaForCausalLM"]  # vLLM reads it as EAGLE's (method "eagle")
    head_config.save_pretrained(out_dir / "draft")
    weights = target.state_dict()
    hidden = int(weights["model.embed_tokens.weight"].shape[1])
    head = {"embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
            "fc.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1).contiguous()}
    head.update({name.removeprefix("model."): value.clone().contiguous() for name, value in weights.items()
                 if name.startswith("model.layers.0.") and "input_layernorm" not in name})
    save_file(head, str(out_dir / "draft" / "model.safetensors"))  # no lm_head: vLLM shares the target's
    return out_dir / "target", out_dir / "draft"


def build_draft_models(out_dir: Path) -> tuple[Path, Path, Path]:
    """(a 2-layer random Llama, two 1-layer draft models for vLLM's
    ``draft_model`` method that compute its logits exactly: one with its KV
    heads, one with a single KV head, another KV spec). The target's layer
    0 ties its two KV heads and its layer 1 adds nothing to the residual
    (its KV is still computed), so layer 0 alone is the model."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    target = LlamaForCausalLM(llama_config(layers=2)).to(torch.float32)
    with torch.no_grad():
        attention = target.model.layers[0].self_attn
        for weight in (attention.k_proj.weight, attention.v_proj.weight):
            weight[HEAD_DIM:2 * HEAD_DIM].copy_(weight[:HEAD_DIM])
        target.model.layers[1].self_attn.o_proj.weight.zero_()
        target.model.layers[1].mlp.down_proj.weight.zero_()
    target.save_pretrained(out_dir / "target")
    weights = target.state_dict()
    for name, kv_heads in (("same_heads", 2), ("one_kv_head", 1)):
        config = llama_config(layers=1)
        config.num_key_value_heads = kv_heads
        draft = LlamaForCausalLM(config).to(torch.float32)
        own = draft.state_dict()
        with torch.no_grad():
            for key, value in own.items():
                value.copy_(weights[key][: value.shape[0]])  # k/v of one head: the tied head's rows
        draft.save_pretrained(out_dir / name)
    return out_dir / "target", out_dir / "same_heads", out_dir / "one_kv_head"


def build_mtp_model(out_dir: Path) -> Path:
    """A 2-layer MiMo (a Qwen2 body) with one MTP module, for vLLM's
    ``mtp`` method. Its layer 1 adds nothing to the residual, its embedding
    rows have RMS 1, and the MTP module is layer 0 again reading the token
    embedding alone (``input_proj`` = [0 | I]): it predicts the model from
    its own KV cache (vLLM numbers it as layer 2)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=HEAD_DIM, vocab_size=1000, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=INIT_RANGE,
                         use_sliding_window=False)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    _embedding_rows_at_rms_one(model)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.zero_()
        model.model.layers[1].mlp.down_proj.weight.zero_()
    model.save_pretrained(out_dir)
    described = json.loads((out_dir / "config.json").read_text())
    described.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (out_dir / "config.json").write_text(json.dumps(described))
    weights = load_file(str(out_dir / "model.safetensors"))
    hidden, mtp = config.hidden_size, "model.mtp_layers.0."
    weights.update({mtp + "token_layernorm.weight": torch.ones(hidden), mtp + "hidden_layernorm.weight": torch.ones(hidden),
                    mtp + "final_layernorm.weight": weights["model.norm.weight"].clone(),
                    mtp + "input_proj.weight": torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)})
    weights.update({mtp + name.removeprefix("model.layers.0."): value.clone() for name, value in list(weights.items())
                    if name.startswith("model.layers.0.")})
    save_file({name: value.contiguous() for name, value in weights.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    return out_dir


def write_lora(out_dir: Path, seed: int, rank: int = 8) -> Path:
    """A random PEFT LoRA adapter of :func:`build_llama`'s model (over what is there)."""
    import torch
    from safetensors.torch import save_file

    config = llama_config()
    hidden, kv = config.hidden_size, config.num_key_value_heads * HEAD_DIM
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for module, out in (("q_proj", hidden), ("k_proj", kv), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.1
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": "tiny-llama",
    }))
    return out_dir


def build_hub_cache(hub: Path, repo_id: str, snapshots: dict[str, Path], main: str) -> Path:
    """``hub/models--ORG--NAME`` holding each ``snapshots[commit]`` directory's
    files as blobs (named by their sha256, as ``huggingface_hub`` names LFS
    blobs) linked from ``snapshots/<commit>/``, with ``refs/main`` at ``main``."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for commit, source in snapshots.items():
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        for file in sorted(source.iterdir()):
            data = file.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            if not blob.exists():
                blob.write_bytes(data)
            link = snapshot / file.name
            if not link.is_symlink():
                link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs" / "main").write_text(main)
    return repo


def start_job(spec: dict[str, Any], work_dir: Path, name: str) -> Any:
    """Starts this script on ``spec`` as ``e2e_helpers.start_engine_process``
    starts ``engine_job.py`` (a fork of the session's server unless ``env``
    names a variable read at import time); ``.wait()`` gives the result."""
    import subprocess

    from e2e_helpers import EngineProcess
    from engine_forkserver import forks_wanted, session_server

    spec_path = work_dir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    result_path, log_path = work_dir / f"{name}.result.json", work_dir / f"{name}.log"
    argv = [str(Path(__file__).resolve()), str(spec_path), str(result_path)]
    if forks_wanted(spec.get("env", {})):
        return EngineProcess(session_server().start(argv, log_path), result_path, log_path)
    env = {**os.environ, **spec.get("env", {})}
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env)
    return EngineProcess(proc, result_path, log_path)


def ucm_db_hits(log: str) -> list[int]:
    """The hit tokens of each lookup ucm-db logged, in order."""
    return [int(m.group(3)) for m in HIT_LINE.finditer(log)]


def step_logs(log: str) -> list[str]:
    """A ``"steps"`` job's log, cut at each engine's start."""
    return re.split(re.escape(STEP_MARK) + r"\d+\n", log)[1:]


# ------------------------------------------------------------------ the job


def _run(llm: Any, prompts: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs, cached = [], []
    for prompt in prompts:
        tokens = TokensPrompt(prompt_token_ids=prompt["ids"])
        if prompt.get("cache_salt"):
            tokens["cache_salt"] = prompt["cache_salt"]
        lora = LoRARequest(*prompt["lora"]) if prompt.get("lora") else None
        out = llm.generate([tokens], params, use_tqdm=False, lora_request=lora)[0]
        outputs.append(list(out.outputs[0].token_ids))
        cached.append(int(out.num_cached_tokens or 0))
    return {"outputs": outputs, "cached": cached}


STEP_MARK = "identity-helpers: engine step "


def _engine(spec: dict[str, Any]) -> dict[str, Any]:
    import engine_job

    started = time.perf_counter()
    try:
        llm = engine_job.make_engine(spec)
    except Exception as exc:  # noqa: BLE001 - a refusal is the result where the spec expects one
        if not spec.get("start_may_fail"):
            raise
        traceback.print_exc()
        return {"start_error": f"{type(exc).__name__}: {exc}"}
    start_s = time.perf_counter() - started
    try:
        result = _run(llm, spec["prompts"], spec.get("max_tokens", 4))
        if spec.get("metrics"):  # needs "disable_log_stats": False in engine_kwargs
            result["metrics"] = {m.name: m.value for m in llm.get_metrics()
                                 if isinstance(getattr(m, "value", None), (int, float))}
    finally:
        llm.llm_engine.engine_core.shutdown()
    result["engine_start_s"] = start_s
    return result


def main() -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    os.environ.update(spec.get("env", {}))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if "steps" not in spec:
        result = _engine(spec)
    else:  # engines one after another in this process (one import of vLLM), each after its file writes
        result = {"steps": []}
        for index, step in enumerate(spec["steps"]):
            for path, text in step.get("write_files", {}).items():
                Path(path).write_text(text)
            print(f"{STEP_MARK}{index}", flush=True)
            result["steps"].append(_engine(step))
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
