"""The README's main job: a vLLM engine on CPU with ucm-db, restarted.

    python -m ucm_db.connector.demo [--store PATH] [--prompts 6] [--prefix-tokens 1536]

1. Builds (once, cached under ``$UCM_DB_DEMO_DIR`` or ``~/.cache/ucm-db-demo``)
   a random-weight Llama small enough for a CPU (6 layers, ~50M parameters)
   with ``transformers`` and ``save_pretrained``: no download.
2. Pass 1: starts a vLLM engine (new process) with ``UcmDbConnector`` on the
   embedded default store path (``$UCM_DB_PATH`` or ``~/.cache/ucm-db``,
   unless ``--store``), and sends prompts that share long prefixes, one by
   one.
3. Pass 2: stops that engine, starts a fresh one (new process: vLLM's own
   prefix cache is empty) and sends the same prompts again.

For each pass it prints, per prompt, the tokens served by vLLM's own prefix
cache and by ucm-db, the time to first token, their medians, and the store's
stats. Each run uses new random prompts (the seed is printed), so pass 1 is
cold even when the store already holds earlier runs.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ucm_db.connector.engine_process import add_job_argument, run_in_new_process, serve_job

BLOCK_SIZE = 32
_HIT_LINE = re.compile(r"ucm-db: request (\S+): (\d+) prompt tokens, (\d+) from vLLM's prefix cache, (\d+) hit tokens")


def demo_dir() -> Path:
    return Path(os.environ.get("UCM_DB_DEMO_DIR") or Path.home() / ".cache" / "ucm-db-demo")


def build_model(out_dir: Path, *, layers: int = 6, hidden: int = 768, seed: int = 0) -> Path:
    """A random-weight Llama (bf16) in ``out_dir``; reused if present."""
    if (out_dir / "config.json").exists():
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=4, head_dim=64, vocab_size=8000,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent if out_dir.parent.exists() else None))
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
    tmp.rename(out_dir)  # atomic: a half-written model is never reused
    return out_dir


def make_prompts(seed: int, count: int, prefix_tokens: int, suffix_tokens: int) -> list[list[int]]:
    """``count`` prompts: two groups, each sharing a ``prefix_tokens`` prefix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 8000) for _ in range(prefix_tokens)] for _ in range(2)]
    return [prefixes[i % 2] + [rng.randrange(3, 8000) for _ in range(suffix_tokens)] for i in range(count)]


#: Log-probabilities kept per prompt, and the gap under which two tokens are
#: a near-tie that bf16 summation order may flip (see compare_first_tokens).
TOP_LOGPROBS = 5
NEAR_TIE_LOGPROB = 0.05


# -- one engine pass (runs in a child process) ---------------------------------------
def run_pass(spec: dict[str, Any]) -> dict[str, Any]:
    """Starts one engine, sends ``spec['prompts']`` one by one (max_tokens=1)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if spec.get("reserved_cpus") is not None:
        # Benchmarks pin vLLM's CPU layout: see docs/vllm-cpu-connector-effect.md.
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(spec["reserved_cpus"])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", block_size=BLOCK_SIZE,
        max_model_len=spec.get("max_model_len", 4096), max_num_seqs=4, seed=0,
        enable_prefix_caching=spec.get("prefix_caching", True),
    )
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["connector"],
        }
    started = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
    ttft_s, cached, first_tokens, top_logprobs = [], [], [], []
    try:
        warm = [random.Random(time.time_ns()).randrange(3, 8000) for _ in range(64)]
        llm.generate([TokensPrompt(prompt_token_ids=warm)], params, use_tqdm=False)  # first-request overheads
        for ids in spec["prompts"]:
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            ttft_s.append(time.perf_counter() - t0)
            cached.append(int(out.num_cached_tokens or 0))
            first_tokens.append(out.outputs[0].token_ids[0])
            top = (out.outputs[0].logprobs or [{}])[0]
            top_logprobs.append({str(token): float(entry.logprob) for token, entry in top.items()})
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"engine_start_s": start_s, "ttft_s": ttft_s, "cached": cached, "first_tokens": first_tokens,
            "top_logprobs": top_logprobs}


def compare_first_tokens(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """Per prompt: ``same``, ``near-tie`` or ``DIFFERENT``.

    The demo model has random weights, so its next-token logits are nearly
    flat, and a prompt computed in a different order (all of it in pass 1,
    only the tail after loading the prefix in pass 2) can flip the argmax
    between two tokens whose log-probabilities differ in the last bits of
    bf16 arithmetic. A flip counts as a ``near-tie`` only if each pass has the
    other's token in its top ``TOP_LOGPROBS`` and pass 1 scored the two within
    ``NEAR_TIE_LOGPROB``. Wrong KV changes the whole distribution instead.
    """
    verdicts = []
    for a, b, top_a, top_b in zip(first["first_tokens"], second["first_tokens"], first["top_logprobs"], second["top_logprobs"]):
        if a == b:
            verdicts.append("same")
        elif str(b) in top_a and str(a) in top_b and abs(top_a[str(a)] - top_a[str(b)]) <= NEAR_TIE_LOGPROB:
            verdicts.append(f"near-tie ({abs(top_a[str(a)] - top_a[str(b)]):.4f})")
        else:
            verdicts.append("DIFFERENT")
    return verdicts


def run_pass_in_new_process(spec: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
    """``run_pass`` in a fresh Python process; hit lines parsed from its log."""
    result, text = run_in_new_process("ucm_db.connector.demo", spec, work, name)
    result["ucm_hits"] = [(int(m[2]), int(m[3])) for m in _HIT_LINE.findall(text)][1:]  # [0] is the warm-up
    return result


# -- reporting ------------------------------------------------------------------------
def print_pass(title: str, prompts: list[list[int]], result: dict[str, Any]) -> None:
    print(f"\n== {title}  (engine start {result['engine_start_s']:.0f} s)")
    print(f"   {'prompt':>6} {'tokens':>7} {'vLLM cache':>11} {'ucm-db hit':>11} {'TTFT ms':>9}")
    hits = result.get("ucm_hits") or [(0, 0)] * len(prompts)
    for i, (ids, ttft, (local, ucm)) in enumerate(zip(prompts, result["ttft_s"], hits)):
        print(f"   {i:>6} {len(ids):>7} {local:>11} {ucm:>11} {1e3 * ttft:>9.1f}")
    total_ucm = sum(h[1] for h in hits)
    print(f"   ucm-db hit tokens: {total_ucm} of {sum(len(p) for p in prompts)} prompt tokens;"
          f" median TTFT {1e3 * statistics.median(result['ttft_s']):.1f} ms")


def print_store(path: Path) -> None:
    import ucm_db

    with ucm_db.open(path) as store:
        s = store.stats()
    print(f"   store {s.path}: {s.blocks} blocks, {s.raw_bytes / 1e6:.1f} MB raw -> {s.stored_bytes / 1e6:.1f} MB stored"
          f" (compression {s.compression_ratio:.2f}x), file {s.file_bytes / 1e6:.1f} MB, hits {s.hits}, misses {s.misses},"
          f" evictions {s.evictions}, quarantined {s.quarantined}, namespaces {len(s.namespaces)}")


def store_problem(path: Path) -> str | None:
    """Why the engines could not open the store (e.g. an older format), said
    here in one line instead of from inside a vLLM worker's traceback."""
    import ucm_db

    try:
        ucm_db.open(path).close()
    except ucm_db.UcmDbError as exc:
        return str(exc)  # the message carries the fix as its hint
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ucm_db.connector.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", type=Path, default=None, help="store path (default: the embedded default path)")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prefix-tokens", type=int, default=1536)
    parser.add_argument("--suffix-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=None)
    add_job_argument(parser)
    args = parser.parse_args(argv)
    if args.run_spec:
        return serve_job(args.run_spec, run_pass)
    from ucm_db.connector.settings import default_store_path

    store = args.store or default_store_path()
    seed = args.seed if args.seed is not None else time.time_ns() % 1_000_000
    base = demo_dir()
    base.mkdir(parents=True, exist_ok=True)
    print(f"ucm-db demo: store {store} | model dir {base / 'model'} | prompt seed {seed}", flush=True)
    problem = store_problem(store)
    if problem:
        print(f"ucm-db demo: cannot use the store at {store}: {problem}", file=sys.stderr)
        return 2
    model = build_model(base / "model")
    prompts = make_prompts(seed, args.prompts, args.prefix_tokens, args.suffix_tokens)
    connector = {} if args.store is None else {"path": str(store)}
    spec = {"model": str(model), "connector": connector, "prompts": prompts}
    with tempfile.TemporaryDirectory(prefix="ucm-db-demo-") as tmp:
        print("pass 1: starting a vLLM engine (CPU) with ucm-db ...", flush=True)
        first = run_pass_in_new_process(spec, Path(tmp), "pass1")
        print_pass("pass 1: fresh engine, prompts never seen", prompts, first)
        print_store(store)
        print("\npass 2: engine stopped; starting a NEW engine process on the same store ...", flush=True)
        second = run_pass_in_new_process(spec, Path(tmp), "pass2")
        print_pass("pass 2: restarted engine (vLLM's own cache is empty)", prompts, second)
        print_store(store)
    verdicts = compare_first_tokens(first, second)
    speedup = statistics.median(first["ttft_s"]) / statistics.median(second["ttft_s"])
    print(f"\nfirst token, pass 2 vs pass 1, per prompt: {', '.join(verdicts)}")
    print(f"median TTFT pass 1 / pass 2 = {speedup:.2f}x")
    return 1 if "DIFFERENT" in verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
