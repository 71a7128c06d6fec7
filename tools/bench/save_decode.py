"""What ``save_decode`` keeps and costs on conversations that decode: ``ucm-db bench save-decode``
(issue 49, item 2).

    ucm-db bench save-decode [--conversations 8] [--turns 6] [--output-tokens 128] [--quick] [--json]

A real vLLM engine on CPU (a random-weight 2-layer, 256-wide Llama, block
size 32, greedy, ``ignore_eos``) with the ucm-db connector serves
``--conversations`` conversations of ``--turns`` turns; every turn's requests
(one per conversation) are sent together, and each generates
``--output-tokens`` tokens. Two workloads differ only in what the next turn's
prompt holds:

* ``chat``: the previous prompt, the tokens the engine generated for it, and
  a new ``--user-tokens`` message (a chat template that renders the reply
  as generated);
* ``reasoning``: the previous prompt and the new message; the generated
  tokens are dropped, as reasoning models' chat templates drop the reasoning.

The first turn's prompt is a ``--first-tokens`` message. Each
``save_decode`` value gets its own engine in a new process with a new store
(``codec: "none"``, ``load_policy: "always"``: every stored hit is loaded,
whatever the cost model would say of a model this small); the workloads run
in it one after the other, on token ids drawn apart, so neither can hit the
other's blocks (a workload's bytes are the store's growth over it; the store
never evicts here, checked).

vLLM's own prefix cache is emptied before every turn
(``LLM.reset_prefix_cache()``, which leaves the connector alone), as a
server holding many conversations would have evicted a conversation's blocks
by its next turn: every prompt token not computed is then a ucm-db hit. The
saves of each turn are committed (the worker drained) before the next turn
is sent, as a user's think time allows.

Reported per (workload, save_decode):

* ``stored_bytes``: what the store holds of the workload at its end
  (``Store.stats().stored_bytes``, growth over the workload), and its records
  (``Store.stats().blocks``: the connector stores a block as per-head units);
* ``hit_tokens``: tokens ucm-db served, the connector's ``hit_tokens``
  counter (claims at lookup; with vLLM's cache emptied and every load
  succeeding, equal to vLLM's ``num_cached_tokens``, also reported);
* ``prefilled_tokens``: prompt tokens vLLM computed;
* ``ideal_hit_tokens``: the prompt tokens an unbounded cache could serve
  (:func:`ideal_hits`), and the hits' share of them.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from ucm_db.tools.bench.cpu_dtype import DTYPES, fast_dtype
from ucm_db.tools.bench.engine_pass import build_model, demo_dir
from ucm_db.tools.bench.engine_process import run_in_new_process

BLOCK_SIZE = 32
WORKLOADS = ("chat", "reasoning")
LAYERS, HIDDEN, VOCAB = 2, 256, 8000  # build_model's vocabulary
CAPACITY_BYTES = 4 << 30
#: Workload sizes: the defaults, and --quick's (an option given wins over both). Messages
#: are not whole blocks, so where a prompt ends inside a block moves from turn to turn.
SIZES = {"conversations": 8, "turns": 6, "first_tokens": 250, "user_tokens": 70, "output_tokens": 128}
QUICK_SIZES = {"conversations": 2, "turns": 3, "first_tokens": 90, "user_tokens": 40, "output_tokens": 64}


# -- the pure parts: messages, prompts, what an ideal cache serves ---------------------
def messages(workload: str, conversations: int, turns: int, first_tokens: int, user_tokens: int,
             seed: int) -> list[list[list[int]]]:
    """Each conversation's user messages, one per turn (the first
    ``first_tokens`` long, the others ``user_tokens``); a workload's ids are
    drawn apart from another's (the seed is salted with its name)."""
    rng = random.Random(f"{seed}-{workload}")
    return [[[rng.randrange(3, VOCAB) for _ in range(first_tokens if turn == 0 else user_tokens)] for turn in range(turns)]
            for _ in range(conversations)]


def next_prompt(workload: str, prompt: Sequence[int], output: Sequence[int], message: Sequence[int]) -> list[int]:
    """The next turn's prompt: ``chat`` sends the reply back, ``reasoning`` drops it."""
    if workload == "chat":
        return [*prompt, *output, *message]
    if workload == "reasoning":
        return [*prompt, *message]
    raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def ideal_hits(batches: Sequence[Sequence[tuple[Sequence[int], Sequence[int]]]], block_size: int) -> list[list[int]]:
    """For each request ``(prompt, output)`` of each batch (a batch's
    requests are sent together, so each reuses only earlier batches' KV):
    the longest prefix of its prompt whose KV an earlier request computed,
    in whole blocks, leaving the prompt's last token to compute (as vLLM
    does). A request computes KV for its prompt and every generated token
    but the last, which is sampled and never fed back."""
    computed: list[list[int]] = []
    out: list[list[int]] = []
    for batch in batches:
        hits = []
        for prompt, _ in batch:
            longest = max((_common_prefix(prompt, seq) for seq in computed), default=0)
            hits.append(min(longest, len(prompt) - 1) // block_size * block_size)
        out.append(hits)
        computed.extend([*prompt, *output[:-1]] for prompt, output in batch)
    return out


# -- the engine job (runs in a child process) --------------------------------------------
def _snapshot(sched: Any) -> dict[str, int]:
    stats = sched.store.stats()
    return {"stored_bytes": stats.stored_bytes, "records": stats.blocks, "evictions": stats.evictions,
            "hit_tokens": int(sched.counters.totals.data["hit_tokens"])}


def _run_workload(llm: Any, sched: Any, worker: Any, workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=spec["output_tokens"], temperature=0.0, ignore_eos=True)
    chats = messages(workload, spec["conversations"], spec["turns"], spec["first_tokens"], spec["user_tokens"], spec["seed"])
    prompts = [chat[0] for chat in chats]
    before = _snapshot(sched)
    batches, cached = [], []
    for turn in range(spec["turns"]):
        if not llm.reset_prefix_cache():  # vLLM's cache empty: every token not computed is ucm-db's
            raise RuntimeError("vLLM refused to reset its prefix cache")
        results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        worker.drain()  # this turn's saves committed before the next turn is sent
        outputs = [list(r.outputs[0].token_ids) for r in results]
        batches.append(list(zip(prompts, outputs)))
        cached.append([int(r.num_cached_tokens or 0) for r in results])
        if turn + 1 < spec["turns"]:
            prompts = [next_prompt(workload, p, o, chat[turn + 1]) for p, o, chat in zip(prompts, outputs, chats)]
    after = _snapshot(sched)
    if after["evictions"] != before["evictions"]:
        raise RuntimeError("the store evicted blocks: its bytes and hits no longer measure save_decode")
    ideal = ideal_hits(batches, BLOCK_SIZE)
    prompt_tokens = sum(len(p) for batch in batches for p, _ in batch)
    return {
        "stored_bytes": after["stored_bytes"] - before["stored_bytes"], "stored_records": after["records"] - before["records"],
        "hit_tokens": after["hit_tokens"] - before["hit_tokens"], "vllm_cached_tokens": sum(map(sum, cached)),
        "prompt_tokens": prompt_tokens, "prefilled_tokens": prompt_tokens - sum(map(sum, cached)),
        "ideal_hit_tokens": sum(map(sum, ideal)), "output_tokens": sum(len(o) for batch in batches for _, o in batch),
        "per_turn": [{"prompt_tokens": sum(len(p) for p, _ in batch), "cached_tokens": sum(c), "ideal_hit_tokens": sum(i)}
                     for batch, c, i in zip(batches, cached, ideal)],
    }


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine (in this process: its connector's store and counters are
    read here) with ``spec['save_decode']``; every workload of
    ``spec['workloads']`` in turn. Runs in the child."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm import LLM
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    started = time.perf_counter()
    llm = LLM(
        model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"], block_size=BLOCK_SIZE,
        max_model_len=spec["max_model_len"], max_num_seqs=spec["conversations"], seed=0, enable_prefix_caching=True,
        enforce_eager=True,  # nothing here is timed: no compile
        kv_transfer_config={
            "kv_connector": "UcmDbConnector", "kv_connector_module_path": "ucm_db.connector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"path": spec["store"], "codec": "none", "load_policy": "always",
                                          "save_decode": spec["save_decode"], "capacity_bytes": CAPACITY_BYTES},
        },
    )
    out: dict[str, Any] = {"engine_start_s": time.perf_counter() - started, "workloads": {}}
    try:
        client: Any = llm.llm_engine.engine_core  # in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        group: Any = get_kv_transfer_group()
        sched, worker = client.engine_core.scheduler.connector._scheduler, group._worker
        for workload in spec["workloads"]:
            t0 = time.perf_counter()
            out["workloads"][workload] = _run_workload(llm, sched, worker, workload, spec)
            out["workloads"][workload]["wall_s"] = round(time.perf_counter() - t0, 1)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return out


# -- the parent ---------------------------------------------------------------------------
def max_model_len(sizes: dict[str, int]) -> int:
    """A chat's longest sequence (its last prompt and reply), in whole blocks."""
    longest = sizes["first_tokens"] + (sizes["turns"] - 1) * (sizes["output_tokens"] + sizes["user_tokens"]) + sizes["output_tokens"]
    return -(-longest // BLOCK_SIZE) * BLOCK_SIZE


def run(sizes: dict[str, int], save_decodes: Sequence[bool], workloads: Sequence[str], seed: int,
        dtype: str | None) -> dict[str, Any]:
    """One engine per ``save_decode`` value, each in a new process on a new store."""
    base = demo_dir()
    base.mkdir(parents=True, exist_ok=True)
    model = build_model(base / f"bench-model-{LAYERS}x{HIDDEN}", layers=LAYERS, hidden=HIDDEN)
    chosen = fast_dtype(dtype)
    rows: list[dict[str, Any]] = []
    engines: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ucm-db-save-decode-") as tmp:
        work = Path(tmp)
        for save_decode in save_decodes:
            name = f"save_decode-{str(save_decode).lower()}"
            spec = {**sizes, "model": str(model), "dtype": chosen.dtype, "seed": seed, "workloads": list(workloads),
                    "save_decode": save_decode, "store": str(work / f"store-{name}"), "max_model_len": max_model_len(sizes)}
            print(f"  {name}: 1 engine, {', '.join(workloads)} ...", file=sys.stderr, flush=True)
            result, _ = run_in_new_process("save_decode_engine", spec, work, name,
                                           progress=lambda line: print(f"    {line}", file=sys.stderr, flush=True))
            engines[name] = {"engine_start_s": round(result["engine_start_s"], 1)}
            for workload, row in result["workloads"].items():
                share = row["hit_tokens"] / row["ideal_hit_tokens"] if row["ideal_hit_tokens"] else 1.0
                rows.append({"workload": workload, "save_decode": save_decode, **row, "hit_share_of_ideal": round(share, 4)})
    rows.sort(key=lambda r: (WORKLOADS.index(r["workload"]), not r["save_decode"]))
    return {
        "model": f"llama {LAYERS} layers x {HIDDEN} hidden, {chosen.dtype}, random weights", "dtype_reason": chosen.reason,
        "block_size": BLOCK_SIZE, "codec": "none", "sizes": sizes, "seed": seed, "rows": rows, "engines": engines,
        "host": {"cpus": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()]},
    }


def format_table(report: dict[str, Any]) -> str:
    s = report["sizes"]
    lines = [
        f"save_decode on conversations that decode: {s['conversations']} conversations x {s['turns']} turns, first message "
        f"{s['first_tokens']} tokens, then {s['user_tokens']}-token messages, {s['output_tokens']} output tokens a turn "
        f"(greedy, ignore_eos); {report['model']}, block {report['block_size']}, codec {report['codec']}; vLLM's prefix cache "
        "emptied before every turn",
        f"{'workload':<10} {'save_decode':>11} {'stored MB':>10} {'records':>8} {'hit tokens':>10} {'prefilled':>10} "
        f"{'prompt tok':>10} {'ideal hits':>10} {'hit/ideal':>9}",
    ]
    for r in report["rows"]:
        lines.append(f"{r['workload']:<10} {str(r['save_decode']).lower():>11} {r['stored_bytes'] / 1e6:>10.2f} "
                     f"{r['stored_records']:>8} {r['hit_tokens']:>10} {r['prefilled_tokens']:>10} {r['prompt_tokens']:>10} "
                     f"{r['ideal_hit_tokens']:>10} {r['hit_share_of_ideal']:>9.3f}")
    by_key = {(r["workload"], r["save_decode"]): r for r in report["rows"]}
    for workload in WORKLOADS:
        on, off = by_key.get((workload, True)), by_key.get((workload, False))
        if on and off:
            lines.append(f"{workload}: save_decode true stores {on['stored_bytes'] / max(1, off['stored_bytes']):.2f}x the "
                         f"bytes of false and serves {on['hit_tokens'] - off['hit_tokens']:+d} hit tokens "
                         f"({on['prefilled_tokens'] - off['prefilled_tokens']:+d} prefilled)")
    mismatched = [f"{r['workload']}/{str(r['save_decode']).lower()}" for r in report["rows"] if r["hit_tokens"] != r["vllm_cached_tokens"]]
    if mismatched:
        lines.append(f"note: connector hit tokens differ from vLLM's cached tokens in {', '.join(mismatched)} (see --json)")
    lines.append(f"load average {report['host']['load_avg'][0]:.1f} on {report['host']['cpus']} CPUs; engine starts "
                 + ", ".join(f"{n} {e['engine_start_s']} s" for n, e in report["engines"].items()))
    return "\n".join(lines)


def _choices(allowed: Sequence[str]) -> Any:
    def parse(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
        parts = [part.strip().lower() for part in value.split(",") if part.strip()]
        bad = [part for part in parts if part not in allowed]
        if bad or not parts or len(set(parts)) != len(parts):
            raise click.BadParameter(f"want a comma list of distinct values from {', '.join(allowed)}; got {value!r}")
        return parts
    return parse


@click.command("save-decode", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--conversations", type=click.IntRange(min=1), help=f"conversations per workload [{SIZES['conversations']}]")
@click.option("--turns", type=click.IntRange(min=2), help=f"turns per conversation [{SIZES['turns']}]")
@click.option("--first-tokens", type=click.IntRange(min=1), help=f"the first turn's message [{SIZES['first_tokens']}]")
@click.option("--user-tokens", type=click.IntRange(min=1), help=f"each later turn's new message [{SIZES['user_tokens']}]")
@click.option("--output-tokens", type=click.IntRange(min=2), help=f"tokens generated a turn [{SIZES['output_tokens']}]")
@click.option("--save-decode", "save_decode", default="true,false", show_default=True, callback=_choices(("true", "false")),
              help="the values to run, one engine each")
@click.option("--workloads", default=",".join(WORKLOADS), show_default=True, callback=_choices(WORKLOADS))
@click.option("--seed", type=int, default=7, show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default=None, help="model dtype [the one this CPU runs fast]")
@click.option("--quick", is_flag=True, help="tiny sizes for a smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK_SIZES.items()))
@click.option("--json", "as_json", is_flag=True, help="print JSON only")
def command(conversations: int | None, turns: int | None, first_tokens: int | None, user_tokens: int | None,
            output_tokens: int | None, save_decode: list[str], workloads: list[str], seed: int, dtype: str | None,
            quick: bool, as_json: bool) -> None:
    """Bytes stored and hits served with save_decode true and false, on chat and reasoning conversations.

    A real vLLM engine on CPU (tiny random Llama) per save_decode value; chat
    sends each reply back in the next turn's prompt, reasoning drops it.

    \b
    Example:
        ucm-db bench save-decode
        ucm-db bench save-decode --quick --json
        ucm-db bench save-decode --conversations 4 --turns 8 --output-tokens 96 --save-decode false
    """
    given = {"conversations": conversations, "turns": turns, "first_tokens": first_tokens, "user_tokens": user_tokens,
             "output_tokens": output_tokens}
    sizes = {k: v if v is not None else (QUICK_SIZES if quick else SIZES)[k] for k, v in given.items()}
    report = run(sizes, [value == "true" for value in save_decode], workloads, seed, dtype)
    click.echo(json.dumps(report, indent=2) if as_json else format_table(report))


if __name__ == "__main__":
    command()
