"""Run one vLLM engine job in a fresh Python process (demo and benchmarks).

A job is ``python -m MODULE --run-spec SPEC.json RESULT.json``: the module
reads the spec, runs an engine, writes a JSON result. Output goes to a log
file, never a pipe: an engine writing to a pipe nobody reads can hang, and a
fresh process is what "after a restart" means.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RUN_SPEC_FLAG = "--run-spec"


def run_in_new_process(module: str, spec: dict[str, Any], work: Path, name: str) -> tuple[dict[str, Any], str]:
    """Runs ``module``'s job for ``spec``; returns its result and its log text.

    Raises:
        SystemExit: the job failed (the message holds the end of its log).
    """
    spec_path, result_path, log_path = work / f"{name}.json", work / f"{name}.result.json", work / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    with log_path.open("wb") as log:
        rc = subprocess.call(
            [sys.executable, "-m", module, RUN_SPEC_FLAG, str(spec_path), str(result_path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    text = log_path.read_text(errors="replace")
    if rc != 0:
        raise SystemExit(f"engine job {name!r} failed (exit {rc}); last lines of {log_path}:\n{text[-3000:]}")
    return json.loads(result_path.read_text()), text


def add_job_argument(parser: argparse.ArgumentParser) -> None:
    """Adds the hidden ``--run-spec SPEC RESULT`` option of a job module."""
    parser.add_argument(RUN_SPEC_FLAG, dest="run_spec", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)


def serve_job(run_spec: Sequence[str], job: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """The child's side: reads the spec, runs ``job``, writes its result."""
    spec = json.loads(Path(run_spec[0]).read_text())
    Path(run_spec[1]).write_text(json.dumps(job(spec)))
    return 0
