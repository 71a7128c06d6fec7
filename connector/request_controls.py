"""What the connector stores and loads for a request: the request's own
controls.

Request controls ride in the request's ``kv_transfer_params`` under the
connector's one key (:data:`~ucm_db.connector.roles.PARAMS_KEY`, the key a
producer's publication uses too)::

    {"ucm_db": {"save": false, "load": false, "max_load_tokens": 256}}

* ``save`` (true, false or ``"always"``; default true): false stores
  nothing of the request; ``"always"`` stores every computed block of it
  that ``save_decode`` allows from the first sighting, whatever
  ``admit_after`` says (cache warming: :func:`~ucm_db.connector.warming.warm_engine` sends it).
* ``load`` (bool, default true): false looks nothing up and loads nothing;
  vLLM's ``skip_reading_prefix_cache`` (a request's sampling or pooling
  parameter, set by vLLM itself for ``prompt_logprobs``) counts as
  ``load: false``.
* ``max_load_tokens`` (int >= 0, default none): at most this many tokens
  are loaded from ucm-db, rounded down to whole blocks (vLLM's own prefix
  cache hit does not count against it); the lookup asks no further. Below
  one block nothing is loaded and no lookup is counted (the local tier is
  still asked which of vLLM's own cached blocks it holds, so they are not
  saved again).

A streaming session's chunks each send their own (:func:`request_params`);
a chunk's ``save: false`` holds for every later one (:meth:`RequestControls.within_session`).

The deployment's admission of computed blocks (``save_decode``,
``admit_after``) is :mod:`ucm_db.connector.admission`'s.

Invariants:
    * A request's controls are parsed in one place
      (:meth:`RequestControls.from_params`), once per request state; the
      result is a frozen value. A request is never refused for its
      controls; what is wrong with them is reported (all of a request's
      problems in one message, once per request in this process:
      :func:`first_report`), each with what the request was served as.
    * A malformed control fails closed: it is served as the value that
      does least (``save`` and ``load`` false, ``max_load_tokens`` 0), so
      a client that asked for privacy in a wrong type (``"save":
      "false"``) never has its prompt stored; so is a body under
      ``ucm_db`` that is not an object, or one that cannot be read
      (:data:`FAIL_CLOSED`). An unknown field is ignored, and ``null`` is
      absent (the default). Keys of ``kv_transfer_params`` other than
      ``ucm_db`` belong to other connectors and are never read.
    * The publication fields (:data:`PUBLICATION_FIELDS`,
      :meth:`~ucm_db.connector.roles.Publication.to_params`) share the key
      and are not controls: never reported.
    * This module imports no vLLM (the settings parse it in any process).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ucm_db.connector.roles import PARAMS_KEY
from ucm_db.errors import ConfigError

#: The fields a producer's publication writes under the same key
#: (roles.Publication.to_params); tests/connector/test_request_controls.py keeps the two in step.
PUBLICATION_FIELDS = frozenset({"version", "namespace", "blocks", "block_size", "tokens", "last_key", "published_to", "stores"})
#: Requests whose problems were reported, remembered so each is reported once
#: though several schedulers (a hybrid model's groups, MultiConnector's
#: children) parse the same request, and again after a reset renews its state.
REPORTED_REQUESTS = 4096
#: Problems a request's one warning names (then a count), and characters of a value or field name it shows.
MAX_PROBLEMS_NAMED = 5
DESCRIBED_CHARS = 40
#: Where vLLM's sampling parameters carry a request's ``kv_transfer_params`` (``extra_args``).
TRANSFER_PARAMS = "kv_transfer_params"
#: The ``save`` control that stores a request's blocks whatever admission says.
SAVE_ALWAYS: Literal["always"] = "always"


def described(value: Any) -> str:
    """A client's value as a warning names it: short, and computed without
    raising or running long (``repr`` of a value nested 1000 deep raised
    RecursionError in the scheduler, which ended the engine; of a 10 MB
    string it made a 10 MB log line)."""
    try:
        if value is None or isinstance(value, (bool, float)):
            return repr(value)
        if isinstance(value, int):
            return repr(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
        if isinstance(value, str):
            return repr(value[:DESCRIBED_CHARS]) + (f"... ({len(value)} characters)" if len(value) > DESCRIBED_CHARS else "")
        if isinstance(value, (list, tuple)):
            return f"a list of {len(value)} items"
        if isinstance(value, Mapping):
            return f"an object of {len(value)} fields"
        return f"a {type(value).__name__}"
    except Exception:  # noqa: BLE001 - a value a client built to break this: named by nothing
        return "a value"


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_save(value: Any) -> bool:
    return isinstance(value, bool) or (isinstance(value, str) and value == SAVE_ALWAYS)


def _is_token_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: Every control: its check, what it wants, and what a malformed value is
#: served as (the value that does least: module invariants); the one table
#: parsing, construction and the warning use.
_FIELDS: dict[str, tuple[Callable[[Any], bool], str, bool | int]] = {
    "save": (_is_save, 'true, false or "always"', False),
    "load": (_is_bool, "true or false", False),
    "max_load_tokens": (_is_token_count, "an integer >= 0", 0),
}


def _served_as(name: str) -> str:
    """What a malformed ``name`` is served as, as the warning says it."""
    safe = _FIELDS[name][2]
    return f"served as {name} {str(safe).lower()}"


@dataclass(frozen=True, slots=True)
class RequestControls:
    """One request's controls (module docstring); the defaults are a
    request that sent none."""

    save: bool | Literal["always"] = True  # "always": SAVE_ALWAYS
    load: bool = True
    max_load_tokens: int | None = None

    def __post_init__(self) -> None:
        for name, (valid, wanted, _) in _FIELDS.items():
            value = getattr(self, name)
            if value is not None and not valid(value):
                raise ConfigError(f"request control {name!r} must be {wanted}, got {described(value)}",
                                  hint=f'send e.g. {{"{PARAMS_KEY}": {{"{name}": ...}}}} with {wanted}')

    def max_load_blocks(self, block_size: int) -> int | None:
        """The most blocks a lookup may claim (None: no cap)."""
        return None if self.max_load_tokens is None else self.max_load_tokens // block_size

    def loads_nothing(self, block_size: int) -> bool:
        """True where no block may be loaded for the request: ``load`` off,
        or ``max_load_tokens`` below one block (counted as no lookup)."""
        return not self.load or self.max_load_blocks(block_size) == 0

    def claimable_blocks(self, block_size: int, max_blocks: int, num_computed_tokens: int) -> int:
        """The most leading blocks a lookup may claim: the prompt's loadable
        ``max_blocks``, and no more than ``max_load_tokens`` past vLLM's own hit."""
        cap = self.max_load_blocks(block_size)
        return max_blocks if cap is None else min(max_blocks, num_computed_tokens // block_size + cap)

    @classmethod
    def from_params(cls, params: Any) -> tuple[RequestControls, tuple[str, ...]]:
        """The controls in a request's ``kv_transfer_params`` and the
        problems found, each saying what the request is served as (a
        malformed control fails closed: module invariants)."""
        if not isinstance(params, Mapping) or params.get(PARAMS_KEY) is None:
            return cls(), ()
        body = params[PARAMS_KEY]
        if not isinstance(body, Mapping):
            return FAIL_CLOSED, (f"{PARAMS_KEY!r} is {type(body).__name__}, not an object of controls: {CLOSED_AS}",)
        given: dict[str, Any] = {}
        problems: list[str] = []
        for name, (valid, wanted, safe) in _FIELDS.items():  # looked up, not searched for: a body may hold 100k fields
            value = body.get(name)
            if value is None:
                continue
            if valid(value):
                given[name] = value
            else:
                given[name] = safe
                problems.append(f"{name}={described(value)} (wants {wanted}): {_served_as(name)}")
        known = sum(1 for name in (*_FIELDS, *PUBLICATION_FIELDS) if name in body)
        unknown = len(body) - known
        named = [name for _, name in zip(range(MAX_PROBLEMS_NAMED), (n for n in body if n not in _FIELDS and n not in PUBLICATION_FIELDS))]
        problems += [f"unknown field {described(name)} (ignored)" for name in named]
        if unknown > len(named):
            problems.append(f"and {unknown - len(named)} more unknown fields (ignored)")
        return cls(**given), tuple(problems)

    @classmethod
    def of_request(cls, request: Any) -> tuple[RequestControls, tuple[str, ...]]:
        """:meth:`from_params` of the request's current ``kv_transfer_params``
        (:func:`request_params`), with vLLM's ``skip_reading_prefix_cache``
        (the request's, or a session chunk's sampling parameters') taken as
        ``load: false``."""
        controls, problems = cls.from_params(request_params(request))
        # getattr: a request object of another vLLM (or a test's) may lack the field.
        skips = getattr(request, "skip_reading_prefix_cache", False) is True or (
            _is_session(request) and getattr(getattr(request, "sampling_params", None), "skip_reading_prefix_cache", None) is True)
        if controls.load and skips:
            controls = cls(controls.save, False, controls.max_load_tokens)
        return controls, problems

    def within_session(self, earlier: RequestControls | None) -> RequestControls:
        """These controls after ``earlier`` ones served to the same request
        (a session's earlier chunk, or the state this one renews): ``save:
        false`` holds, as a later chunk's prompt holds the earlier chunks'
        tokens; ``load`` and ``max_load_tokens`` are each chunk's own. Blocks
        stored before the chunk that said ``save: false`` stay (allowed then)."""
        if earlier is None or earlier.save is not False or self.save is False:
            return self
        return dataclasses.replace(self, save=False)


def _is_session(request: Any) -> bool:
    return getattr(request, "resumable", False) is True


def request_params(request: Any) -> Any:
    """The ``kv_transfer_params`` a request's controls are read from: the
    request's own, which vLLM copies from its sampling parameters'
    ``extra_args`` when it makes the request; for a streaming session (a
    resumable request) those ``extra_args``' themselves, the current
    chunk's (vLLM 0.32's ``_update_request_as_session`` replaces the
    sampling parameters, never ``kv_transfer_params``). A chunk that sent
    none has none (None: the defaults)."""
    if not _is_session(request):
        return getattr(request, "kv_transfer_params", None)
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    return extra.get(TRANSFER_PARAMS) if isinstance(extra, Mapping) else None


#: What a request whose controls cannot be read at all is served as (module invariants).
FAIL_CLOSED = RequestControls(save=False, load=False)
CLOSED_AS = "served as save false, load false"


def describe_problems(problems: Sequence[str]) -> str:
    """The one warning's text for a request's problems."""
    return (f"bad controls in kv_transfer_params[{PARAMS_KEY!r}]: {'; '.join(problems)} "
            f"(controls: {', '.join(f'{name} ({wanted})' for name, (_, wanted, _) in _FIELDS.items())})")


_reported: OrderedDict[bytes, None] = OrderedDict()


def first_report(request_id: str) -> bool:
    """True the first time it is asked for ``request_id`` (of the last
    :data:`REPORTED_REQUESTS` asked), so a request's problems are reported
    once. Ids are kept as 16-byte digests: a client chooses their length."""
    digest = hashlib.blake2b(str(request_id).encode(errors="replace"), digest_size=16).digest()
    if digest in _reported:
        return False
    _reported[digest] = None
    if len(_reported) > REPORTED_REQUESTS:
        _reported.popitem(last=False)
    return True
