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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from ucm_db.connector.fingerprints import UNSETTLED_PREFIX
from ucm_db.connector.request_controls import CLOSED_AS, FAIL_CLOSED, RequestControls, describe_problems, first_report

if TYPE_CHECKING:
    from vllm.v1.request import Request

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
