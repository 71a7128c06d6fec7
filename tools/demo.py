"""The README's main job: a vLLM engine on CPU restarted with ucm-db, against one restarted without it.

    python -m ucm_db.tools.demo [--store PATH] [--prompts 6] [--prefix-tokens 1536]
    python3 dev.py demo [...]        (the same, after setting up .venv)

1. Builds (once, cached under ``$UCM_DB_DEMO_DIR`` or ``~/.cache/ucm-db-demo``)
   a random-weight Llama small enough for a CPU (6 layers, ~50M parameters):
   no download.
2. Pass 1: a vLLM engine (new process) with ``UcmDbConnector`` on the default
   store path (``$UCM_DB_PATH`` or ``~/.cache/ucm-db``, unless ``--store``)
   serves prompts that share long prefixes, one by one; ucm-db stores their KV.
3. The engine stops. Two restarted engines (new processes: vLLM's own prefix
   cache is empty) serve the same prompts: one with ucm-db (pass 2), one
   without (pass 3).

The headline compares passes 2 and 3, what a user gains from ucm-db after a
restart; pass 1 shows where the KV came from. Every engine runs with the
same CPU layout (``VLLM_CPU_NUM_OF_RESERVED_CPU=1``): vLLM-CPU otherwise
gives an engine with a KV connector a different number of cores
(docs/vllm-cpu-connector-effect.md). Each run uses new random prompts (the
seed is printed), so pass 1 is cold even when the store holds earlier runs.
The demo exits 1 if a first token of pass 2 differs from pass 1's (beyond a
near-tie, see :func:`compare_first_tokens`), 2 if the store cannot be used.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from ucm_db.tools.bench.cpu_dtype import DTYPES, DtypeChoice, fast_dtype
from ucm_db.tools.bench.engine_pass import BLOCK_SIZE, build_model, demo_dir, run_pass_in_new_process

#: The gap in log-probability under which two first tokens are a near-tie
#: that bf16 summation order may flip (see compare_first_tokens).
NEAR_TIE_LOGPROB = 0.05
#: VLLM_CPU_NUM_OF_RESERVED_CPU of every engine: vLLM's own layout without a connector.
RESERVED_CPUS = 1

__all__ = ["BLOCK_SIZE", "NEAR_TIE_LOGPROB", "compare_first_tokens", "main", "make_prompts"]


def make_prompts(seed: int, count: int, prefix_tokens: int, suffix_tokens: int) -> list[list[int]]:
    """``count`` prompts: two groups, each sharing a ``prefix_tokens`` prefix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 8000) for _ in range(prefix_tokens)] for _ in range(2)]
    return [prefixes[i % 2] + [rng.randrange(3, 8000) for _ in range(suffix_tokens)] for i in range(count)]


def compare_first_tokens(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """Per prompt: ``same``, ``near-tie`` or ``DIFFERENT``.

    The demo model has random weights, so its next-token logits are nearly
    flat, and a prompt computed in a different order (all of it in pass 1,
    only the tail after loading the prefix in pass 2) can flip the argmax
    between two tokens whose log-probabilities differ in the last bits of
    bf16 arithmetic. A flip counts as a ``near-tie`` only if each pass has the
    other's token in its top 5 (``engine_pass.TOP_LOGPROBS``) and pass 1 scored the two within
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



# -- reporting ------------------------------------------------------------------------
def _progress(line: str) -> None:
    click.echo(f"     {line}")


def print_pass(title: str, prompts: list[list[int]], result: dict[str, Any]) -> None:
    click.echo(f"\n== {title}  (engine start {result['engine_start_s']:.0f} s)")
    click.echo(f"   {'prompt':>6} {'tokens':>7} {'vLLM cache':>11} {'ucm-db hit':>11} {'TTFT ms':>9}")
    hits = result.get("ucm_hits") or [(cached, 0) for cached in result["cached"]]
    for i, (ids, ttft, (local, ucm)) in enumerate(zip(prompts, result["ttft_s"], hits)):
        click.echo(f"   {i:>6} {len(ids):>7} {local:>11} {ucm:>11} {1e3 * ttft:>9.1f}")
    click.echo(f"   median TTFT {1e3 * statistics.median(result['ttft_s']):.1f} ms")


def print_headline(prompts: list[list[int]], with_ucm: dict[str, Any], without: dict[str, Any]) -> None:
    """Restarted engine without ucm-db against restarted engine with it, per prompt and in medians."""
    click.echo("\n== restarted engine, same prompts: without ucm-db vs with ucm-db")
    click.echo(f"   {'prompt':>6} {'tokens':>7} {'without: vLLM cache':>20} {'TTFT ms':>9}   "
               f"{'with: vLLM cache':>17} {'ucm-db hit':>11} {'TTFT ms':>9} {'speed-up':>9}")
    hits = with_ucm.get("ucm_hits") or [(cached, 0) for cached in with_ucm["cached"]]
    for i, ids in enumerate(prompts):
        base_s, ucm_s = without["ttft_s"][i], with_ucm["ttft_s"][i]
        click.echo(f"   {i:>6} {len(ids):>7} {without['cached'][i]:>20} {1e3 * base_s:>9.1f}   "
                   f"{hits[i][0]:>17} {hits[i][1]:>11} {1e3 * ucm_s:>9.1f} {base_s / ucm_s:>8.1f}x")
    base_ms, ucm_ms = (1e3 * statistics.median(r["ttft_s"]) for r in (without, with_ucm))
    click.echo(f"\nrestarted engine, median TTFT over {len(prompts)} prompts: without ucm-db {base_ms:.1f} ms,"
               f" with ucm-db {ucm_ms:.1f} ms: {base_ms / ucm_ms:.2f}x faster")
    # Where vLLM's own cache had nothing (the first prompt of each prefix
    # group), the gap is the whole prefill.
    cold = [i for i, cached in enumerate(without["cached"]) if cached == 0]
    if cold:
        pairs = ", ".join(f"{1e3 * without['ttft_s'][i]:.0f} -> {1e3 * with_ucm['ttft_s'][i]:.0f} ms" for i in cold)
        click.echo(f"prompts vLLM's own cache could not help after the restart ({len(cold)}): {pairs}")


def print_store(path: Path) -> None:
    import ucm_db

    with ucm_db.open(path) as store:
        s = store.stats()
    click.echo(f"   store {s.path}: {s.blocks} blocks, {s.raw_bytes / 1e6:.1f} MB raw -> {s.stored_bytes / 1e6:.1f} MB stored"
               f" (compression {s.compression_ratio:.2f}x), hits {s.hits}, misses {s.misses}, evictions {s.evictions},"
               f" quarantined {s.quarantined}, namespaces {len(s.namespaces)}")


def store_problem(path: Path) -> str | None:
    """Why the engines could not open the store (e.g. an older format), said
    here in one line instead of from inside a vLLM worker's traceback."""
    import ucm_db

    try:
        ucm_db.open(path).close()
    except ucm_db.UcmDbError as exc:
        return str(exc)  # the message carries the fix as its hint
    except OSError as exc:  # e.g. the path is a file or not writable
        return f"{exc} (pass --store with a writable directory)"
    return None


def run_demo(store: Path, explicit_store: bool, prompts: list[list[int]], dtype: DtypeChoice | None = None) -> int:
    """The three passes and the report; returns the exit status."""
    dtype = dtype or fast_dtype()
    click.echo(f"model dtype {dtype.reason}")
    model = build_model(demo_dir() / "model")
    connector = {"path": str(store)} if explicit_store else {}
    spec = {"model": str(model), "prompts": prompts, "reserved_cpus": RESERVED_CPUS, "dtype": dtype.dtype}
    with tempfile.TemporaryDirectory(prefix="ucm-db-demo-") as tmp:
        work = Path(tmp)
        click.echo("pass 1: starting a vLLM engine (CPU) with ucm-db (1-2 minutes on 2 cores) ...")
        first = run_pass_in_new_process({**spec, "connector": connector}, work, "pass1", progress=_progress)
        print_pass("pass 1: fresh engine with ucm-db, prompts never seen (KV stored)", prompts, first)
        print_store(store)
        click.echo("\npass 2: engine stopped; starting a NEW engine process with ucm-db on the same store ...")
        second = run_pass_in_new_process({**spec, "connector": connector}, work, "pass2", progress=_progress)
        print_pass("pass 2: restarted engine with ucm-db (vLLM's own cache is empty)", prompts, second)
        click.echo("\npass 3: the same restart WITHOUT ucm-db (a NEW engine process, no connector) ...")
        third = run_pass_in_new_process({**spec, "connector": None}, work, "pass3", progress=_progress)
        print_pass("pass 3: restarted engine without ucm-db", prompts, third)
    print_store(store)
    print_headline(prompts, second, third)
    verdicts = compare_first_tokens(first, second)
    click.echo(f"first token, pass 2 (ucm-db after restart) vs pass 1, per prompt: {', '.join(verdicts)}")
    return exit_status(verdicts)


def exit_status(verdicts: list[str]) -> int:
    """1 where a first token of pass 2 differs from pass 1's (a near-tie is
    accepted, :func:`compare_first_tokens`), else 0."""
    return 1 if "DIFFERENT" in verdicts else 0


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--store", type=click.Path(path_type=Path), default=None, help="store path (default: the connector's default path)")
@click.option("--prompts", "count", type=click.IntRange(min=2), default=6, show_default=True, help="prompts, in two prefix groups")
@click.option("--prefix-tokens", type=click.IntRange(min=BLOCK_SIZE), default=1536, show_default=True, help="shared prefix per group")
@click.option("--suffix-tokens", type=click.IntRange(min=1), default=128, show_default=True, help="distinct tail per prompt")
@click.option("--seed", type=int, default=None, help="prompt seed (default: new each run)")
@click.option("--dtype", type=click.Choice(DTYPES), default=None,
              help="model dtype (default: bfloat16 where the CPU has AVX-512 BF16 or AMX, else float32)")
def main(store: Path | None, count: int, prefix_tokens: int, suffix_tokens: int, seed: int | None, dtype: str | None) -> None:
    """A vLLM engine on CPU restarted with ucm-db, against one restarted without it.

    \b
    Example:
        python -m ucm_db.tools.demo --prompts 6 --prefix-tokens 1536
    """
    from ucm_db.connector.settings import default_store_path

    path = store or default_store_path()
    seed = seed if seed is not None else time.time_ns() % 1_000_000
    base = demo_dir()
    base.mkdir(parents=True, exist_ok=True)
    click.echo(f"ucm-db demo: store {path} | model dir {base / 'model'} | prompt seed {seed}")
    problem = store_problem(path)
    if problem:
        click.echo(f"ucm-db demo: cannot use the store at {path}: {problem}", err=True)
        sys.exit(2)
    sys.exit(run_demo(path, store is not None, make_prompts(seed, count, prefix_tokens, suffix_tokens), fast_dtype(dtype)))


if __name__ == "__main__":
    main()
