"""``ucm-db bench``: a click group naming the benchmarks, each imported only when used.

The benchmarks live in :mod:`ucm_db.tools.bench` (measuring code). This
module holds only their names and where each command is, so the CLI's
start-up imports no benchmark code: a command's module is imported when the
command runs or its help is shown.

Invariants:
    * :data:`BENCHMARKS` lists every benchmark command; each target is a
      ``click.Command`` named like its key, and :data:`SUMMARIES` holds its
      short help (tests/test_bench_layout.py), so the group's help imports
      no benchmark either.
"""

from __future__ import annotations

import importlib

import click

#: Subcommand -> "module:attribute" of its click command.
BENCHMARKS = {
    "core": "ucm_db.tools.bench.core:command",
    "engines": "ucm_db.tools.bench.engines:command",
    "remote": "ucm_db.tools.bench.remote:command",
    "remote-codec": "ucm_db.tools.bench.remote_codec:command",
    "remote-crypto": "ucm_db.tools.bench.remote_crypto:command",
    "codec-pool": "ucm_db.tools.bench.codec_pool:command",
    "codec-frames": "ucm_db.tools.bench.codec_frames:command",
    "ttft": "ucm_db.tools.bench.ttft:command",
    "overhead": "ucm_db.tools.bench.overhead:command",
    "tp": "ucm_db.tools.bench.tp:command",
    "scale": "ucm_db.tools.bench.scale:command",
    "index-layouts": "ucm_db.tools.bench.index_layouts:command",
    "serve": "ucm_db.tools.bench.serve:command",
    "cost": "ucm_db.tools.bench.cost:command",
    "remote-lookup": "ucm_db.tools.bench.remote_lookup:command",
    "pd": "ucm_db.tools.bench.pd:command",
    "load": "ucm_db.tools.bench.load:command",
    "gil": "ucm_db.tools.bench.gil:command",
    "hooks": "ucm_db.tools.bench.hooks:command",
    "presence": "ucm_db.tools.bench.presence:command",
    "admission": "ucm_db.tools.bench.admission:command",
    "save-decode": "ucm_db.tools.bench.save_decode:command",
    "public-api": "ucm_db.tools.bench.public_api:command",
    "restart": "ucm_db.tools.bench.restart:command",
    "agentic": "ucm_db.tools.bench.agentic:command",
    "writer": "ucm_db.tools.bench.writer:command",
    "lmdb-floor": "ucm_db.tools.bench.lmdb_floor:command",
    "recency": "ucm_db.tools.bench.recency:command",
    "eviction-depth": "ucm_db.tools.bench.eviction_depth:command",
    "staged": "ucm_db.tools.bench.staged:command",
    "device-load": "ucm_db.tools.bench.device_load:command",
    "inventory-stall": "ucm_db.tools.bench.inventory_stall:command",
}

#: Subcommand -> its short help, so `ucm-db bench --help` imports no benchmark (tests/test_bench_layout.py holds
#: each equal to its command's).
SUMMARIES: dict[str, str] = {
    'core': 'The store against baselines measured in the same run: put, get, codec, lookup, keys, scale.',
    'engines': 'The LMDB and RocksDB engines side by side through the Store API (put, get, lookup).',
    'remote': 'The remote tier against raw fsspec: upload, download, lookup round trips, a remote that is down.',
    'remote-codec': 'Remote codec none vs zstd vs auto on a bandwidth-limited remote (local tier: codec none).',
    'remote-crypto': ('AES-256-GCM sealing/opening vs HMAC-SHA256 per core, and read-through with vs without '
                      'encryption.'),
    'codec-pool': "The codec threads (encode_threads=2) against the caller's thread, by frame size.",
    'codec-frames': 'zstd with adjacent small frames grouped against every frame alone, and codec none.',
    'ttft': ("TTFT: recompute, vLLM's prefix cache, ucm-db and ExampleConnector after a restart (real vLLM engines on "
             'CPU).'),
    'overhead': ('Connector overhead: scheduler lookup of a 32K-token prompt, save path, TTFT at 0% hits (real vLLM '
                 'engines).'),
    'tp': ('Stored bytes at TP=1 vs TP=2 and load throughput of cross-TP against same-TP reads (connector workers, no '
           'engine).'),
    'scale': 'A large store against a small one: open, first hit, lookup, put, verify --sample, compact.',
    'index-layouts': 'Index-only put at a large and a small size, per table layout (bare py-lmdb model).',
    'serve': "vLLM's OpenAI server on CPU with and without ucm-db, under `vllm bench serve` (prefix_repetition).",
    'cost': ('Load or recompute: TTFT with load_policy=auto vs always vs recompute over a throttled remote (real vLLM '
             'on CPU).'),
    'remote-lookup': 'Remote lookups inline vs in the background, over a link with round trips (real vLLM on CPU).',
    'pd': ("Prefill/decode: consumer TTFT vs recompute, the producer's publication wait, TTFT through the proxy (real "
           'vLLM on CPU).'),
    'load': "A connector worker's load and save paths (no engine) against memcpy of the same bytes, same run.",
    'gil': "A model thread's step time alone and beside store work in one process.",
    'hooks': 'Per-step cost of each connector hook in a real engine, c1, unique prompts.',
    'presence': "What a router's presence query costs (Store.lookup_many).",
    'admission': 'Bytes written and hits kept by admit_after N (or auto) on three workloads.',
    'save-decode': 'Bytes stored and hits served with save_decode true and false, on chat and reasoning conversations.',
    'public-api': "The public API's put, get and lookup, for A/B runs of two checkouts.",
    'restart': ('Restart cohort: engine start with and without ucm-db over a filled store, first request after a '
                'restart.'),
    'agentic': "Agent sessions on vLLM's OpenAI server on CPU, with and without ucm-db.",
    'writer': ("In-engine saves (connector worker + background writer) per writer CPU second against bench core's "
               'durable put.'),
    'lmdb-floor': "LMDB's own cost a stored unit (bare py-lmdb), with writemap off and on.",
    'recency': "What readers' LRU touches cost: every touch written against re-touches kept back.",
    'eviction-depth': 'Thread CPU of a put continuing a deep chain in a full store, by depth.',
    'staged': 'Staged loads: get_into a list of staging rows against ScatterSlabs over them.',
    'device-load': 'Loads into (and saves from) KV caches on an accelerator against a plain pinned copy.',
    'inventory-stall': 'Longest put while event_inventory() walks the store, against puts alone.',
}


class LazyBenchGroup(click.Group):
    """A group whose commands are imported from :data:`BENCHMARKS` on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*BENCHMARKS, *self.commands})

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list from :data:`SUMMARIES`: help imports no benchmark (torch, vLLM: seconds)."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = [(name, self._summary(name, limit)) for name in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def _summary(self, name: str, limit: int) -> str:
        if name in SUMMARIES:
            return click.Command(name, help=SUMMARIES[name]).get_short_help_str(limit)  # as the command's own would
        return self.commands[name].get_short_help_str(limit)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands:
            return self.commands[cmd_name]
        if cmd_name not in BENCHMARKS:
            return None
        module, attribute = BENCHMARKS[cmd_name].split(":")
        command = getattr(importlib.import_module(module), attribute)
        if not isinstance(command, click.Command):  # pragma: no cover - guarded by the layout test
            raise TypeError(f"{BENCHMARKS[cmd_name]} is not a click command")
        self.add_command(command, cmd_name)
        return command


@click.group("bench", cls=LazyBenchGroup, context_settings={"help_option_names": ["-h", "--help"]})
def bench_group() -> None:
    """Run one benchmark (listed below; `core` measures the store against baselines taken in the same run).

    Each prints its figures (JSON with --json where offered); targets are
    reported, not enforced. BENCHMARKS.md records results and commands.

    \b
    Example:
        ucm-db bench core --quick
        ucm-db bench load --unit-kib 64
        ucm-db bench engines --blocks 2000
        ucm-db bench ttft --prompts 4 --tokens 2048
    """
