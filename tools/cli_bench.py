"""``ucm-db bench``: a click group naming the benchmarks, each imported only when used.

The benchmarks live in :mod:`ucm_db.tools.bench` (measuring code). This
module holds only their names and where each command is, so the CLI's
start-up imports no benchmark code: a command's module is imported when the
command runs or its help is shown.

Invariants:
    * :data:`BENCHMARKS` lists every benchmark command; each target is a
      ``click.Command`` named like its key (tests/test_bench_layout.py).
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


class LazyBenchGroup(click.Group):
    """A group whose commands are imported from :data:`BENCHMARKS` on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*BENCHMARKS, *self.commands})

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
