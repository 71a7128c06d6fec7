"""What admission keeps and costs: ``admit_after`` N (or ``auto``) on three
workloads (issue 49 item 2), through the connector's real scheduler and worker on a
real store (no vLLM engine: the steps are built as vLLM builds them, the
KV cache is a tensor in vLLM-CPU's layout).

Workloads (block size 32, codec none):

* ``no-reuse``: unique prompts of ``--prompt-tokens`` random ids;
* ``prefix``: ``--prefixes`` shared prefixes of ``--prompt-tokens`` tokens,
  each sent ``--repeats`` times with a new 64-token tail, interleaved;
* ``conversation``: ``--chats`` chats of ``--turns`` turns, each turn's
  prompt the conversation so far (the previous prompt, a 64-token reply
  standing for the answer, a new 64-token message).
* ``fleet``: two engines on one store (a store shared by a node's engines).
  First ``--prompts`` unique prompts, alternating engines (traffic that
  shows no reuse: ``auto`` moves to 2); then ``--documents`` documents of
  ``--prompt-tokens`` tokens, each computed once on one engine and then
  asked about (a 64-token question after it) on the other, so only the
  store carries the reuse: no engine sees a document twice. Hits are
  counted in that second phase.

Reported per N: bytes written (the store's stored bytes), hit tokens, and
for ``prefix`` the hits of every prefix's third and later sightings (what N=2
must keep: a prefix is stored at its second sighting). Targets: no-reuse
bytes with N=2 <= 5% of N=1's; prefix hits after the second sighting with
N=2 >= 99% of N=1's. ``auto`` is reported against N=1: its bytes on
no-reuse (what it writes before it has seen enough to stop) and its hits on
the two workloads that reuse.
"""

from __future__ import annotations

import itertools
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import click
import torch
from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, KVConnectorBlockState, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from ucm_db.connector.identity import KVShape
from ucm_db.connector.scheduler.hooks import UcmDbScheduler
from ucm_db.connector.settings import ConnectorSettings
from ucm_db.connector.worker.hooks import UcmDbWorker

BS = 32
TAIL_TOKENS = 64
SHAPE = KVShape(model="bench-admission", kv_dtype="bfloat16", block_size=BS, use_mla=False, layout="cpu-bench", tp_size=1,
                pp_size=1, kv_heads=2, layers=2)
_ids = itertools.count()


def _step(req: Request, block_ids: list[int], num_tokens: int) -> SchedulerOutput:
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData.from_request(req, (block_ids,))], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={req.request_id: num_tokens}, total_num_scheduled_tokens=num_tokens,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
    )
    out.kv_connector_block_state = KVConnectorBlockState({req.request_id}, lambda rid: (block_ids,), {})
    return out


class _Engine:
    """A scheduler and a worker on one store, each prompt prefilled in one step."""

    def __init__(self, path: Path, admit_after: int | str, max_blocks: int) -> None:
        settings = ConnectorSettings.from_extra_config({"path": str(path), "codec": "none", "load_policy": "always",
                                                        "admit_after": admit_after, "capacity_bytes": 64 << 30})
        self.scheduler = UcmDbScheduler(settings, SHAPE)
        self.worker = UcmDbWorker(settings, SHAPE, max_blocks)
        self.worker.register_kv_caches({f"layers.{i}.attn": torch.zeros(max_blocks, 2, BS, 128, dtype=torch.bfloat16)
                                        for i in range(2)}, 0, 0)

    def prefill(self, tokens: list[int]) -> int:
        """The prompt's hit tokens; its new blocks saved (as admission allows)."""
        req = Request(f"r{next(_ids)}", tokens, SamplingParams(max_tokens=1), None)  # type: ignore[arg-type]
        hit, _ = self.scheduler.get_num_new_matched_tokens(req, 0)
        assert hit is not None
        self.scheduler.update_state_after_alloc(req, None, hit)  # type: ignore[arg-type]
        req.num_computed_tokens = hit
        block_ids = list(range(req.num_tokens // BS + 1))
        self.worker.save(self.scheduler.build_connector_meta(_step(req, block_ids, req.num_tokens - hit)))
        self.worker.drain()
        self.scheduler.request_finished(req, block_ids)
        return hit

    def stored_bytes(self) -> int:
        return self.scheduler.store.stats().stored_bytes

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def _ids_of(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 30_000) for _ in range(n)]


def workloads(prompt_tokens: int, prompts: int, prefixes: int, repeats: int, chats: int, turns: int,
              seed: int) -> dict[str, list[tuple[list[int], str | None]]]:
    """Each workload's prompts in sending order, with the prefix each repeats (None: none)."""
    rng = random.Random(seed)
    no_reuse: list[tuple[list[int], str | None]] = [(_ids_of(rng, prompt_tokens), None) for _ in range(prompts)]
    heads = [_ids_of(rng, prompt_tokens) for _ in range(prefixes)]
    order = [p for p in range(prefixes) for _ in range(repeats)]
    rng.shuffle(order)
    prefix: list[tuple[list[int], str | None]] = [(heads[p] + _ids_of(rng, TAIL_TOKENS), f"p{p}") for p in order]
    conversation: list[tuple[list[int], str | None]] = []
    chat_tokens = [_ids_of(rng, TAIL_TOKENS) for _ in range(chats)]
    for turn in range(turns):
        for c in range(chats):
            conversation.append((list(chat_tokens[c]), None))
            chat_tokens[c] += _ids_of(rng, 2 * TAIL_TOKENS)  # the reply, then the next message
    return {"no-reuse": no_reuse, "prefix": prefix, "conversation": conversation}


def fleet_workload(prompt_tokens: int, prompts: int, documents: int, seed: int) -> list[tuple[list[int], int, bool]]:
    """``fleet``'s prompts in sending order: ``(tokens, engine, counted)``, counted: its hits are reported."""
    rng = random.Random(seed + 1)
    sent = [(_ids_of(rng, prompt_tokens), i % 2, False) for i in range(prompts)]
    for d in range(documents):
        document = _ids_of(rng, prompt_tokens)
        sent += [(document, d % 2, False), (document + _ids_of(rng, TAIL_TOKENS), 1 - d % 2, True)]
    return sent


def run_fleet(prompts: list[tuple[list[int], int, bool]], admit_after: int | str) -> dict[str, Any]:
    max_blocks = max(len(t) for t, _, _ in prompts) // BS + 2
    with tempfile.TemporaryDirectory(prefix="ucm-db-admission-") as tmp:
        engines = [_Engine(Path(tmp) / "store", admit_after, max_blocks) for _ in range(2)]
        try:
            hits = [engines[e].prefill(tokens) for tokens, e, _ in prompts]
            return {"stored_bytes": engines[0].stored_bytes(), "hit_tokens": sum(h for h, (_, _, c) in zip(hits, prompts) if c),
                    "prompt_tokens": sum(len(t) for t, _, c in prompts if c)}
        finally:
            for engine in engines:
                engine.close()


def run_one(prompts: list[tuple[list[int], str | None]], admit_after: int | str) -> dict[str, Any]:
    max_blocks = max(len(t) for t, _ in prompts) // BS + 2
    with tempfile.TemporaryDirectory(prefix="ucm-db-admission-") as tmp:
        engine = _Engine(Path(tmp) / "store", admit_after, max_blocks)
        try:
            seen: dict[str, int] = {}
            hits = hits_after_second = 0
            for tokens, prefix in prompts:
                hit = engine.prefill(tokens)
                hits += hit
                if prefix is not None:
                    seen[prefix] = seen.get(prefix, 0) + 1
                    if seen[prefix] >= 3:
                        hits_after_second += hit
            return {"stored_bytes": engine.stored_bytes(), "hit_tokens": hits, "hits_after_second_sighting": hits_after_second,
                    "prompt_tokens": sum(len(t) for t, _ in prompts)}
        finally:
            engine.close()


@click.command("admission", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--admit-after", "admit", default="1,2,3,auto", show_default=True, help="comma list of N or auto")
@click.option("--prompt-tokens", type=click.IntRange(min=BS), default=2048, show_default=True)
@click.option("--prompts", type=click.IntRange(min=1), default=128, show_default=True, help="no-reuse prompts")
@click.option("--prefixes", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--repeats", type=click.IntRange(min=3), default=8, show_default=True, help="sightings of each prefix")
@click.option("--chats", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--turns", type=click.IntRange(min=2), default=6, show_default=True)
@click.option("--documents", type=click.IntRange(min=1), default=128, show_default=True, help="fleet documents")
@click.option("--seed", type=int, default=7, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON only")
def command(admit: str, prompt_tokens: int, prompts: int, prefixes: int, repeats: int, chats: int, turns: int,
            documents: int, seed: int, as_json: bool) -> None:
    """Bytes written and hits kept by admit_after N (or auto) on three workloads.

    \b
    Example:
        ucm-db bench admission --admit-after 1,2,3,auto --prompts 128 --prefixes 16 --repeats 8
    """
    ns: list[int | str] = [n if n == "auto" else int(n) for n in admit.split(",")]
    loads = workloads(prompt_tokens, prompts, prefixes, repeats, chats, turns, seed)
    report = {name: {n: run_one(prompts_, n) for n in ns} for name, prompts_ in loads.items()}
    fleet = fleet_workload(prompt_tokens, prompts, documents, seed)
    report["fleet"] = {n: run_fleet(fleet, n) for n in ns}
    base = ns[0]
    verdicts = {}
    if 1 in ns and 2 in ns:
        written = report["no-reuse"][2]["stored_bytes"] / max(1, report["no-reuse"][1]["stored_bytes"])
        kept = report["prefix"][2]["hits_after_second_sighting"] / max(1, report["prefix"][1]["hits_after_second_sighting"])
        verdicts = {"no_reuse_bytes_n2_over_n1": round(written, 4), "met_5pct": written <= 0.05,
                    "prefix_hits_after_second_n2_over_n1": round(kept, 4), "met_99pct": kept >= 0.99}
    if 1 in ns and "auto" in ns:
        verdicts["no_reuse_bytes_auto_over_n1"] = round(report["no-reuse"]["auto"]["stored_bytes"]
                                                        / max(1, report["no-reuse"][1]["stored_bytes"]), 4)
        for name in ("prefix", "conversation", "fleet"):
            verdicts[f"{name}_hits_auto_over_n1"] = round(report[name]["auto"]["hit_tokens"] / max(1, report[name][1]["hit_tokens"]), 4)
    if as_json:
        click.echo(json.dumps({"workloads": report, "targets": verdicts}, indent=2))
        return
    click.echo(f"admit_after {admit}: bytes written and hit tokens (relative to N={base})")
    for name, rows in report.items():
        for n, row in rows.items():
            extra = f", after 2nd sighting {row['hits_after_second_sighting']}" if name == "prefix" else ""
            click.echo(f"  {name:<12} N={n}: {row['stored_bytes'] / 1e6:9.2f} MB written "
                       f"({row['stored_bytes'] / max(1, rows[base]['stored_bytes']):.3f}x), "
                       f"{row['hit_tokens']} hit tokens of {row['prompt_tokens']}{extra}")
    click.echo(f"targets: {verdicts}")


if __name__ == "__main__":
    command()
