"""A request's controls as the scheduler serves them: parsed once per
request state (:mod:`ucm_db.connector.request_controls`), with what is
wrong warned about once per request.

Invariants:
    * Never raises for a client's input: controls that cannot be read at
      all are served as :data:`~ucm_db.connector.request_controls.FAIL_CLOSED`
      (nothing stored, nothing looked up), as a malformed field is served
      as its value that does least: a privacy control fails closed.
    * An unsettled LoRA adapter's request neither saves nor loads (vLLM may
      compute it with another adapter, fingerprints.py).
    * A request of an adapter vLLM reloaded with other files in this process
      saves nothing where vLLM's own prefix cache served part of it, or where
      it holds multimodal items (:func:`refuse_saves_over_stale_caches`):
      vLLM's prefix cache keys the adapter by name and path, its encoder
      cache a tower adapter by name alone (a name loaded from another path
      counts there), so their KV or encoder outputs may be the old files',
      and every block computed over them is wrong for the new adapter's key.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from ucm_db.connector.fingerprints import UNSETTLED_PREFIX, adapter_resettled
from ucm_db.connector.request_controls import CLOSED_AS, FAIL_CLOSED, RequestControls, describe_problems, first_report

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from ucm_db.connector.scheduler.request_state import RequestState

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log handler prints it


def served_controls(request: Request, extras: dict[str, Any]) -> RequestControls:
    """The controls ``request`` is served with (module invariants);
    ``extras``: its hashed extras (request_keys.request_extras)."""
    if str(extras.get("lora", "")).startswith(UNSETTLED_PREFIX):  # vLLM may compute with another adapter
        return FAIL_CLOSED
    try:
        controls, problems = RequestControls.of_request(request)
    except Exception as exc:  # noqa: BLE001 - a client's input never ends the engine (nor stores a private prompt)
        controls, problems = FAIL_CLOSED, (f"unreadable ({type(exc).__name__}): {CLOSED_AS}",)
    if problems and first_report(request.request_id):
        logger.warning("ucm-db: request %.80s: %s", request.request_id, describe_problems(problems))  # a client sets the id
    return controls


def refuse_saves_over_stale_caches(state: RequestState, vllm_hit_tokens: int) -> None:
    """Turns the request's saves off (module invariants) where its adapter was
    reloaded with other files and vLLM's own cache served ``vllm_hit_tokens``
    of it, or it holds multimodal items; warned once, when it turns them off."""
    request = state.request
    multimodal = state.mm_items > 0
    if not state.controls.save or not (vllm_hit_tokens or multimodal) or not adapter_resettled(request.lora_request, multimodal=multimodal):
        return
    state.controls = dataclasses.replace(state.controls, save=False)  # so it returns at once from here on
    logger.warning("ucm-db: request %.80s: LoRA adapter %r was reloaded with other files while vLLM's prefix cache "
                   "(keyed by name and path) may hold the old files' KV: nothing of this request is saved (%d tokens "
                   "from vLLM's cache%s); restart the engine, or load the new adapter under a new name or path, to "
                   "save its KV again", request.request_id, str(request.lora_request.lora_name), vllm_hit_tokens,
                   ", multimodal items" if state.mm_items > 0 else "")


def log_not_looked_up(state: RequestState) -> None:
    """The request's log line where its controls left nothing to look up."""
    request = state.request
    why = ("the request's 'load' control or vLLM's skip_reading_prefix_cache" if not state.controls.load
           else "the request's max_load_tokens is below one block")
    logger.info("ucm-db: request %s: %d prompt tokens, not looked up (load off: %s)", request.request_id, request.num_prompt_tokens, why)
