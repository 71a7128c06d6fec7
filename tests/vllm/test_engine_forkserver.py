"""The engine fork server (``engine_forkserver.py``) keeps what its docstring
promises: a forked job runs its script as ``python SCRIPT ARGS`` would (the
arguments, working directory, environment, ``__main__``, atexit handlers, exit
code, output in the log), a killed job reports its signal, the server exits
when the process that started it is gone, and a spec whose ``env`` names a
variable read at import time gets a new process instead of a fork.

These run a bare server (no vLLM preloaded): what is tested is the forking;
every engine module of this folder runs through the preloaded one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import e2e_helpers
from engine_forkserver import EngineForkServer, ForkedJob, forkable_env

PROBE = textwrap.dedent('''
    import atexit, json, os, sys
    atexit.register(lambda: open(sys.argv[2], "w").write("atexit ran"))
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "name": __name__,
                      "probe_env": os.environ.get("UCM_DB_PROBE"), "stdin": sys.stdin.read(),
                      "leads_session": os.getsid(0) == os.getpid()}))
    mode = sys.argv[1]
    if mode == "raise":
        raise RuntimeError("probe failed on purpose")
    if mode == "sleep":
        import time
        time.sleep(600)
    sys.exit(int(mode))
''')


@pytest.fixture(scope="module")
def bare_server(tmp_path_factory: pytest.TempPathFactory):
    server = EngineForkServer(tmp_path_factory.mktemp("forks"), preload=False)
    yield server
    server.stop()


def _probe(tmp_path: Path) -> Path:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return script


def test_a_forked_job_runs_like_a_new_process(bare_server: EngineForkServer, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    script, marker, log = _probe(tmp_path), tmp_path / "atexit.txt", tmp_path / "job.log"
    monkeypatch.setenv("UCM_DB_PROBE", "from the client")
    monkeypatch.chdir(tmp_path)
    job = bare_server.start([str(script), "3", str(marker)], log)
    assert isinstance(job, ForkedJob) and job.pid != os.getpid()
    assert job.wait(60) == 3 and job.poll() == 3
    seen = json.loads(log.read_text().splitlines()[-1])
    assert seen == {"argv": ["3", str(marker)], "cwd": str(tmp_path), "name": "__main__",
                    "probe_env": "from the client", "stdin": "", "leads_session": False}
    assert marker.read_text() == "atexit ran"


def test_a_module_job_with_its_own_session(bare_server: EngineForkServer, tmp_path: Path) -> None:
    """``-m MODULE ARGS`` as ``python -m`` runs it; ``new_session`` as Popen's ``start_new_session``."""
    data, log = tmp_path / "data.json", tmp_path / "job.log"
    data.write_text('{"b": 1, "a": [2]}')
    job = bare_server.start(["-m", "json.tool", "--sort-keys", "--compact", str(data)], log, new_session=True)
    assert job.wait(60) == 0
    assert log.read_text().strip() == '{"a":[2],"b":1}'
    script, log = _probe(tmp_path), tmp_path / "sleeper.log"
    job = bare_server.start([str(script), "sleep", str(tmp_path / "atexit.txt")], log, env={"UCM_DB_PROBE": "only"},
                            new_session=True)
    deadline = time.monotonic() + 30
    while not (log.exists() and log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = json.loads(log.read_text().splitlines()[-1])
    assert seen["leads_session"] and seen["probe_env"] == "only"
    os.killpg(job.pid, signal.SIGKILL)
    assert job.wait(60) == -signal.SIGKILL


def test_an_uncaught_exception_is_exit_code_1_with_its_traceback(bare_server: EngineForkServer, tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    job = bare_server.start([str(_probe(tmp_path)), "raise", str(tmp_path / "atexit.txt")], log)
    assert job.wait(60) == 1
    assert "RuntimeError: probe failed on purpose" in log.read_text()
    assert (tmp_path / "atexit.txt").exists()


def test_a_killed_job_reports_the_signal_and_wait_times_out_before(bare_server: EngineForkServer, tmp_path: Path) -> None:
    job = bare_server.start([str(_probe(tmp_path)), "sleep", str(tmp_path / "atexit.txt")], tmp_path / "job.log")
    with pytest.raises(subprocess.TimeoutExpired):
        job.wait(0.5)
    assert job.poll() is None
    job.kill()
    assert job.wait(60) == -signal.SIGKILL


def test_the_server_exits_when_its_parent_is_gone(tmp_path: Path) -> None:
    starter = textwrap.dedent(f'''
        import sys, time
        sys.path.insert(0, {str(Path(e2e_helpers.__file__).parent)!r})
        from pathlib import Path
        from engine_forkserver import EngineForkServer
        server = EngineForkServer(Path({str(tmp_path)!r}), preload=False)
        print(server.proc.pid, flush=True)
        time.sleep(600)
    ''')
    parent = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    server_pid = int(parent.stdout.readline())
    os.kill(server_pid, 0)  # running
    parent.kill()
    parent.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"fork server {server_pid} outlived the process that started it")


def test_only_vllm_variables_are_forkable() -> None:
    assert forkable_env({}) and forkable_env({"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert not forkable_env({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": "1"})


def test_a_spec_with_an_import_time_variable_gets_a_new_process(tmp_path: Path) -> None:
    """engine_job refuses an unknown "processes" before it imports vLLM, so this costs no engine."""
    bad = {"processes": "bogus", "env": {"OMP_NUM_THREADS": "1"}, "model": "unused", "prompts": []}
    engine = e2e_helpers.start_engine_process(bad, tmp_path, "bad")
    assert isinstance(engine.proc, subprocess.Popen)
    with pytest.raises(AssertionError, match='"processes" is \'bogus\''):
        engine.wait(120)
