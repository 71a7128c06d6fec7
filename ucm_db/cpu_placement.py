"""Where the store's background threads run, in a process that pins its
compute.

vLLM on CPU binds its model's OpenMP threads to cores
(``VLLM_CPU_OMP_THREADS_BIND``), and every thread the worker process starts
afterwards inherits that binding: compression, decoding and uploads would
take turns with the model on its own cores while the cores vLLM reserved
stay idle. A host that knows this names the cores for background work once
per process (:func:`set_background_cpus`, for example with
:func:`spare_cpus` of the CPUs the host was started with);
each background thread of the store (codec, maintenance, upload, remote
requests, background promotion) and of its
host places itself there when it starts (:func:`place_current_thread`).

Invariants:
    * Nothing moves until :func:`set_background_cpus` names a non-empty set:
      by default threads keep the CPUs they inherit.
    * Placement never fails a thread: an affinity the OS refuses (a cpuset
      that shrank, a CPU number beyond the kernel's mask, a platform without
      ``sched_setaffinity``) leaves the thread where it was. A value that is
      no CPU number at all (negative, a bool, a str) is refused when named
      (:func:`set_background_cpus`), not in every thread that starts later.
    * CPUs outside the process's cpuset are never used: the kernel keeps a
      thread's affinity inside its cgroup's cpuset (a set with none of
      those CPUs is refused, leaving the thread where it was).
    * Threads already running stay where they are; only threads that start
      (or call :func:`place_current_thread`) afterwards move.
"""

from __future__ import annotations

import numbers
import os
import threading
from collections.abc import Iterable

_lock = threading.Lock()
_background_cpus: frozenset[int] = frozenset()


def set_background_cpus(cpus: Iterable[int] | None) -> None:
    """CPUs for the store's background threads started from now on, in
    this process (None or empty: where they are started, the default).

    Raises:
        ValueError: an entry is not a CPU number (an int >= 0); the set
            named before stays. (A plain ValueError: this module and
            :mod:`ucm_db.errors` share the lowest layer.)
    """
    global _background_cpus
    named = list(cpus or ())
    bad = [c for c in named if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 0]
    if bad:
        raise ValueError(f"background CPUs are CPU numbers (ints >= 0), got {bad[0]!r}; "
                         "name CPUs as os.sched_getaffinity returns them, e.g. {2, 3}")
    with _lock:
        _background_cpus = frozenset(int(c) for c in named)


def background_cpus() -> frozenset[int]:
    """The set named by :func:`set_background_cpus` (empty: none)."""
    return _background_cpus


def place_current_thread() -> None:
    """Moves the calling thread to the background CPUs, if any are named,
    and gives it its Python name in the OS (:func:`name_current_thread`)."""
    name_current_thread()
    cpus = _background_cpus
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)
        except (OSError, ValueError, OverflowError):
            pass  # see the invariants: the thread stays where it was


def name_current_thread() -> None:
    """Gives the calling thread its Python name (first 15 bytes) as its OS
    name, where Linux lets it (``/proc/self/task/TID/comm``): ``top -H``,
    ``ps -L`` and a profiler then tell ucm-db's threads from the host's,
    which they otherwise share a name with. A process's main thread keeps
    the process's name. Never fails."""
    thread = threading.current_thread()
    if thread is threading.main_thread():
        return
    name = thread.name.encode(errors="replace")[:15]
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "wb") as comm:
            comm.write(name)
    except OSError:
        pass  # not Linux, or /proc not mounted: the name is a convenience


def spare_cpus(allowed: Iterable[int]) -> frozenset[int]:
    """The CPUs of ``allowed`` that the calling thread is not bound to
    (empty where affinity is unknown).

    ``allowed`` is the caller's to know: what the host process was started
    with (a ``taskset``/``numactl`` binding, the CPUs it leaves to others),
    never simply every CPU of the machine."""
    if not hasattr(os, "sched_getaffinity"):
        return frozenset()
    return frozenset(int(c) for c in allowed) - frozenset(os.sched_getaffinity(0))
