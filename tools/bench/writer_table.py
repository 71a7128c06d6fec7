"""The table ``ucm-db bench writer`` prints (its ``--json`` report as text)."""

from __future__ import annotations

from typing import Any


def format_table(report: dict[str, Any]) -> str:
    o, b, m = report["options"], report["baseline"], report["model"]
    lines = [
        f"in-engine saves (connector worker + BackgroundWriter), vLLM CPU layout, bf16, {m['kv_heads']} KV heads x head "
        f"{m['head_size']}, block {m['block_size']}; jobs of {','.join(map(str, o['job_blocks']))} blocks (cycled) from "
        f"{o['requests']} requests, {o['jobs']} jobs; codec {o['codec']}, durability group, {o['store']} {o.get('engine', 'lmdb')} stores; medians of {o['repeat']}",
        f"baseline (bench core's durable put, {b['blocks']} x 2 MiB, codec {o['codec']}): {b['put_gbps']['value']:.3f} GB/s wall, "
        f"{b['put_gbps_per_cpu_s']['value']:.3f} GB/s per CPU s",
        "",
        f"{'case':<12} {'unit':>7} {'commits':>7} {'wall':>7} {'writer':>7} {'x put':>6} {'commit':>7} {'x put':>6} "
        f"{'off-eng':>7} {'x put':>6} {'ms/commit':>9} {'written':>7}  target >= {report['target']}x",
        f"{'':<12} {'KiB':>7} {'':>7} {'GB/s':>7} {'GB/s/s':>7} {'':>6} {'GB/s/s':>7} {'':>6} {'GB/s/s':>7} {'':>9} {'x saved':>7}",
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['case']:<12} {r['unit_bytes'] >> 10:>7} {r['commits']:>7.0f} {r['wall_gbps']['value']:>7.3f} "
            f"{r['writer_gbps_per_cpu_s']['value']:>7.3f} {r['writer_x_put']['value']:>6.2f} {r['commit_gbps_per_cpu_s']['value']:>7.3f} "
            f"{r['commit_x_put']['value']:>6.2f} {r['off_engine_gbps_per_cpu_s']['value']:>7.3f} {r['off_engine_x_put']['value']:>6.2f} "
            f"{r['writer_cpu_ms_per_commit']['value']:>9.3f} "
            f"{r['written_x_saved']['value'] if r['written_x_saved'] else float('nan'):>7.2f}  {'met' if r['target']['met'] else 'MISSED'}")
    lines.append("GB/s/s: GB/s of saved KV per CPU second (writer thread; its commit counter; all but the engine's thread)")
    load = ", ".join(f"{x:.2f}" for x in report["host"]["load_avg_at_start"])
    lines.append(f"{report['host']['cpus']} CPUs, load average at start {load}; {report['elapsed_s']} s")
    return "\n".join(lines)
