"""vLLM's model inspection inside the test processes.

Before an engine starts, vLLM inspects its model class (``_ModelInfo``: is
it hybrid, multimodal, ...) in a new interpreter, so that its own process
never initialises CUDA, unless its cache (``modelinfos`` under
``VLLM_CACHE_ROOT``, ``~/.cache/vllm``) holds the answer for that model
file. On this CPU-only suite each miss is a whole import of vLLM, about
17 s of CPU on 2 cores: paid per architecture on a new machine (CI), and
per engine where engines of a new architecture start together.

:func:`inspect_in_process` makes this process, and every fork of it, run
the same inspection of the same class in place; vLLM saves the answer to
the same cache, where the processes vLLM spawns find it. The test session
calls it once collection has imported vLLM (tests/conftest.py), and so
does the engine fork server (tests/vllm/engine_forkserver.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _in_place(fn: Callable[[], T]) -> T:
    return fn()


def inspect_in_process() -> bool:
    """True once vLLM's inspection runs in this process; False, changing
    nothing, where this vLLM inspects some other way."""
    from vllm.model_executor.models import registry

    if not callable(getattr(registry, "_run_in_subprocess", None)):
        return False
    registry._run_in_subprocess = _in_place  # type: ignore[attr-defined]
    return True
