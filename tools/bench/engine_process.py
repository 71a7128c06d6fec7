"""Run one vLLM engine job in a fresh Python process (the demo and the engine benchmarks).

A job is ``python -m ucm_db.tools.bench.engine_process JOB SPEC.json
RESULT.json``: the child looks ``JOB`` up in :data:`JOBS`, runs it on the
spec and writes its JSON result. Output goes to a log file, never a pipe: an
engine writing to a pipe nobody reads can hang, and a fresh process is what
"after a restart" means.

Invariants:
    * Only the jobs named in :data:`JOBS` run; a spec and a result are plain
      JSON (nothing is unpickled).
    * While a job runs, the parent reports the last line of the job's log
      every ``heartbeat_s`` when it changed (else every ``3 * heartbeat_s``),
      so a 40-60 s engine start is never silent.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

#: Job name -> "module:function"; the function takes the spec dict and returns a JSON-able dict.
JOBS = {
    "engine_pass": "ucm_db.tools.bench.engine_pass:run_pass",
    "ttft_engine": "ucm_db.tools.bench.ttft:run_engine",
    "cost_engine": "ucm_db.tools.bench.cost:run_engine",
    "remote_lookup_engine": "ucm_db.tools.bench.remote_lookup:run_engine",
    "save_decode_engine": "ucm_db.tools.bench.save_decode:run_engine",
    "restart_engine": "ucm_db.tools.bench.restart_engine:run_engine",
    "hooks_engine": "ucm_db.tools.bench.hooks:run_engine",
}


def run_in_new_process(job: str, spec: dict[str, Any], work: Path, name: str, *,
                       progress: Callable[[str], None] | None = None, heartbeat_s: float = 10.0) -> tuple[dict[str, Any], str]:
    """Runs ``job`` on ``spec`` in a child process; returns its result and its log text.

    Args:
        progress: called with a short status line (elapsed seconds and the
            log's last line) while the job runs; see the module invariants.

    Raises:
        SystemExit: the job failed (the message holds the end of its log).
    """
    if job not in JOBS:
        raise ValueError(f"unknown engine job {job!r}; known: {', '.join(JOBS)}")
    spec_path, result_path, log_path = work / f"{name}.json", work / f"{name}.result.json", work / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    started = time.monotonic()
    with log_path.open("wb") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", __name__, job, str(spec_path), str(result_path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),  # the heartbeat shows the log as it is written
        )
        shown, shown_at = "", started
        while True:
            try:
                rc = child.wait(timeout=heartbeat_s)
                break
            except subprocess.TimeoutExpired:
                now, line = time.monotonic(), _last_line(log_path)
                # A new log line at once; an unchanged one at most every 3 beats.
                if progress is not None and (line != shown or now - shown_at >= 3 * heartbeat_s):
                    progress(f"{now - started:4.0f} s  {line}")
                    shown, shown_at = line, now
    text = log_path.read_text(errors="replace")
    if rc != 0:
        raise SystemExit(f"engine job {name!r} failed (exit {rc}); last lines of {log_path}:\n{text[-3000:]}")
    return json.loads(result_path.read_text()), text


def _last_line(log_path: Path, width: int = 100) -> str:
    """The log's last non-empty line, shortened (vLLM's start-up messages say where it is)."""
    with log_path.open("rb") as log:
        log.seek(0, 2)
        log.seek(max(0, log.tell() - 4096))
        lines = [line.strip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    last = lines[-1] if lines else "(no output yet)"
    return last if len(last) <= width else last[: width - 3] + "..."


def _resolve(job: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    module, function = JOBS[job].split(":")
    return getattr(importlib.import_module(module), function)  # type: ignore[no-any-return]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("job", type=click.Choice(sorted(JOBS)))
@click.argument("spec_path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("result_path", type=click.Path(dir_okay=False, path_type=Path))
def main(job: str, spec_path: Path, result_path: Path) -> None:
    """The child's side: reads SPEC_PATH, runs JOB, writes RESULT_PATH (JSON)."""
    spec = json.loads(spec_path.read_text())
    result_path.write_text(json.dumps(_resolve(job)(spec)))


if __name__ == "__main__":
    main()
