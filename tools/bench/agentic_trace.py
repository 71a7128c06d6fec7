"""The agentic workload's requests (issue 50, item 6): the trace format, the
seeded session generator, the token ids a request sends, and the prefix
reuse a cache that forgets nothing would get. Pure functions, no engine
(:mod:`.agentic_run` sends the requests, :mod:`.agentic` reports).

A trace is JSON lines, one request each::

    {"session": "s003", "arrival_s": 4.25, "input_len": 2048, "output_len": 24, "hash_ids": [0, 1, 57, 58]}

``hash_ids`` name the prompt's blocks of ``block_tokens`` tokens each, in
order (the style of public agentic traces, e.g. Mooncake's 512-token hash
ids): two requests whose hash ids start alike share that prefix. The ids of
a request cover its prompt (at most ``ceil(input_len / block_tokens)`` of
them; the last block may be cut short); prompt tokens past the last id are
the request's own.

The generator (:func:`generate`) makes ``sessions`` agent sessions of
``turns`` turns. Every session starts with the same ``shared_tokens``
(system prompt and tool definitions); each turn's prompt is the session so
far plus new blocks: the first tokens of a turn's new blocks stand for the
previous answer (fixed seeded tokens, not the engine's answer, so every row
sends the same prompts; the KV vLLM computed while decoding is never reused,
in any row alike) and the rest for the tool's result. The last turn's prompt
reaches ``context_tokens``. Turn ``k`` of session ``s`` arrives at
``(k + s / sessions) * gap_s``: a tool call of ``gap_s`` between turns, the
sessions interleaved so that, in arrival order, every session's turn ``k``
comes before any session's turn ``k + 1``.

Invariants:
    * The same spec gives the same requests; the same hash id gives the
      same token block (ids seeded by ``(seed, 0, hash_id)``), and the
      tokens past a request's ids are seeded by ``(seed, 1, index)``, its
      position in the trace; ids are never the tokenizer's special ids.
    * A generated session's turn ``k`` prompt is a prefix of its turn
      ``k + 1`` prompt (its hash ids are), and prompt lengths are whole
      blocks of ``block_tokens``.
    * :func:`read_trace` returns requests sorted by ``arrival_s`` (ties in
      file order); :func:`write_trace` then :func:`read_trace` gives the
      same requests back.
    * A bad line raises :class:`TraceError` naming the file, the line, the
      problem and the fix; nothing is replayed from a bad trace.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ucm_db.tools.bench.serve_model import SPECIAL_TOKENS, VOCAB_SIZE

#: A trace line's fields and their JSON types.
FIELDS = {"session": "a string", "arrival_s": "a number of seconds >= 0", "input_len": "an integer >= 1",
          "output_len": "an integer >= 1", "hash_ids": "a list of integers >= 0"}
#: Names other traces give a field: a line missing a field but holding one of these is told to rename it.
ALIASES = {"session": ("session_id", "conversation_id", "chat_id"), "arrival_s": ("timestamp", "arrival", "arrival_time"),
           "input_len": ("input_length", "prompt_len", "input_tokens"),
           "output_len": ("output_length", "output_tokens", "max_tokens"), "hash_ids": ("hashes", "block_hashes")}
#: Public traces' block size (Mooncake's); the generator's default too.
DEFAULT_BLOCK_TOKENS = 512
_LOW_ID = len(SPECIAL_TOKENS)


class TraceError(ValueError):
    """A trace line that cannot be replayed; ``hint`` says what to change."""

    def __init__(self, where: str, problem: str, hint: str) -> None:
        super().__init__(f"{where}: {problem}; fix: {hint}")
        self.hint = hint


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace (a line)."""

    session: str
    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps({"session": self.session, "arrival_s": self.arrival_s, "input_len": self.input_len,
                           "output_len": self.output_len, "hash_ids": list(self.hash_ids)}, separators=(", ", ": "))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_line(text: str, where: str, block_tokens: int) -> TraceRequest:
    """One trace line; raises :class:`TraceError` (at ``where``) if it is not one."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(where, f"not JSON ({exc.msg} at column {exc.colno})",
                         "write one JSON object per line, e.g. " + EXAMPLE_LINE) from exc
    if not isinstance(obj, dict):
        raise TraceError(where, f"a JSON {type(obj).__name__}, not an object", "write one JSON object per line, e.g. " + EXAMPLE_LINE)
    for name, kind in FIELDS.items():
        if name not in obj:
            alias = next((a for a in ALIASES[name] if a in obj), None)
            hint = (f"rename {alias!r} to {name!r} ({kind}" + (", seconds: Mooncake's timestamp is milliseconds" if alias == "timestamp" else "")
                    + ")") if alias else f"add {name!r}, {kind}"
            raise TraceError(where, f"missing field {name!r}", hint)
    session, arrival_s, hash_ids = obj["session"], obj["arrival_s"], obj["hash_ids"]
    if not isinstance(session, str) or not session:
        raise TraceError(where, f"session {session!r} is not a non-empty string", "write the session id as a string, e.g. \"s1\"")
    if not isinstance(arrival_s, (int, float)) or isinstance(arrival_s, bool) or not math.isfinite(arrival_s) or arrival_s < 0:
        raise TraceError(where, f"arrival_s {arrival_s!r} is not {FIELDS['arrival_s']}", "give seconds since the trace's start, >= 0")
    for name in ("input_len", "output_len"):
        if not _is_int(obj[name]) or obj[name] < 1:
            raise TraceError(where, f"{name} {obj[name]!r} is not {FIELDS[name]}", f"give {name} as a token count of at least 1")
    if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
        raise TraceError(where, f"hash_ids is not {FIELDS['hash_ids']}", "list the prompt's block ids, e.g. [0, 1, 57]")
    most = -(-obj["input_len"] // block_tokens)
    if len(hash_ids) > most:
        raise TraceError(where, f"{len(hash_ids)} hash_ids for input_len {obj['input_len']}, more than its "
                         f"{most} blocks of {block_tokens} tokens",
                         "pass the trace's block size as --hash-block-tokens, or fix input_len")
    return TraceRequest(session, float(arrival_s), obj["input_len"], obj["output_len"], tuple(hash_ids))


#: A valid line, quoted in the errors' fixes.
EXAMPLE_LINE = '{"session": "s1", "arrival_s": 0.0, "input_len": 1024, "output_len": 16, "hash_ids": [0, 1]}'


def in_arrival_order(requests: Iterable[TraceRequest]) -> list[TraceRequest]:
    """``requests`` sorted by arrival (a stable sort: ties keep their order)."""
    return sorted(requests, key=lambda r: r.arrival_s)


def read_trace(path: Path, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[TraceRequest]:
    """Every request of the trace at ``path`` in arrival order; blank lines skipped."""
    requests = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                requests.append(parse_line(line, f"{path}:{number}", block_tokens))
    if not requests:
        raise TraceError(str(path), "no requests", "write one JSON line per request, e.g. " + EXAMPLE_LINE)
    return in_arrival_order(requests)


def write_trace(path: Path, requests: Iterable[TraceRequest]) -> None:
    """Writes ``requests`` as a trace, one JSON line each."""
    Path(path).write_text("".join(r.to_json() + "\n" for r in requests), encoding="utf-8")


@dataclass(frozen=True)
class AgenticSpec:
    """The generated workload (see the module docstring)."""

    sessions: int = 16
    turns: int = 8
    context_tokens: int = 8192  # the last turn's prompt is at least this long
    shared_tokens: int = 1024  # system prompt and tool definitions, the same in every session
    min_output_tokens: int = 16
    max_output_tokens: int = 32
    gap_s: float = 2.0  # the tool call between two turns' arrivals
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    seed: int = 7

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "context_tokens", "min_output_tokens", "block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"AgenticSpec.{name} must be at least 1, not {getattr(self, name)}")
        if self.shared_tokens < 0 or self.gap_s < 0 or self.max_output_tokens < self.min_output_tokens:
            raise ValueError("AgenticSpec: shared_tokens and gap_s must be >= 0 and max_output_tokens >= min_output_tokens")
        if self.own_blocks < self.turns:
            raise ValueError(f"{self.turns} turns need at least {self.turns} blocks of {self.block_tokens} tokens past the "
                             f"shared {self.shared_blocks}, but context_tokens {self.context_tokens} leaves {self.own_blocks}: "
                             "raise context_tokens, or lower turns, shared_tokens or block_tokens")

    @property
    def context_blocks(self) -> int:
        """Blocks of the last turn's prompt."""
        return -(-self.context_tokens // self.block_tokens)

    @property
    def shared_blocks(self) -> int:
        return -(-self.shared_tokens // self.block_tokens)

    @property
    def own_blocks(self) -> int:
        """Blocks of a session past the shared ones: the turns' new blocks."""
        return self.context_blocks - self.shared_blocks


def generate(spec: AgenticSpec) -> list[TraceRequest]:
    """The spec's sessions as trace requests, in arrival order."""
    rng = np.random.default_rng(spec.seed)
    shared = list(range(spec.shared_blocks))
    next_id = spec.shared_blocks
    requests = []
    for s in range(spec.sessions):
        # Each turn adds at least one block: turns - 1 distinct cuts of the session's own blocks.
        cuts: list[int] = sorted(rng.choice(np.arange(1, spec.own_blocks), spec.turns - 1, replace=False).tolist())
        parts = np.diff([0, *cuts, spec.own_blocks])
        ids = list(shared)
        for turn, part in enumerate(parts):
            ids += range(next_id, next_id + int(part))
            next_id += int(part)
            output_len = int(rng.integers(spec.min_output_tokens, spec.max_output_tokens + 1))
            arrival_s = round((turn + s / spec.sessions) * spec.gap_s, 6)
            requests.append(TraceRequest(f"s{s:03d}", arrival_s, len(ids) * spec.block_tokens, output_len, tuple(ids)))
    return in_arrival_order(requests)


def hash_block(hash_id: int, block_tokens: int, seed: int) -> np.ndarray:
    """The token ids hash id ``hash_id`` stands for (the same id, the same block)."""
    return np.random.default_rng([seed, 0, hash_id]).integers(_LOW_ID, VOCAB_SIZE, block_tokens)


def request_tokens(requests: list[TraceRequest], block_tokens: int, seed: int) -> list[list[int]]:
    """Each request's prompt token ids: its hash ids' blocks, cut to
    ``input_len``, then (past the ids) tokens of its own, seeded by its index."""
    blocks: dict[int, np.ndarray] = {}
    out = []
    for index, r in enumerate(requests):
        for h in r.hash_ids:
            if h not in blocks:
                blocks[h] = hash_block(h, block_tokens, seed)
        parts = [blocks[h] for h in r.hash_ids]
        ids = np.concatenate(parts)[:r.input_len] if parts else np.empty(0, dtype=np.int64)
        if len(ids) < r.input_len:
            own = np.random.default_rng([seed, 1, index]).integers(_LOW_ID, VOCAB_SIZE, r.input_len - len(ids))
            ids = np.concatenate([ids, own])
        out.append(ids.tolist())
    return out


def reusable_tokens(requests: list[TraceRequest], block_tokens: int, block_size: int, *, warm: bool) -> list[int]:
    """Per request, the prompt tokens a prefix cache that forgets nothing
    serves, in whole engine blocks of ``block_size`` and never the last
    token (vLLM computes it). Cold (a first pass): the longest prefix of
    hash ids an earlier request (in trace order) had, as far as that
    request's prompt went. Warm (the same requests again): every request's
    whole prompt."""
    covered: dict[int, int] = {}  # chain of the first m ids -> tokens of them some request's prompt held
    out = []
    for r in requests:
        if warm:
            out.append((r.input_len - 1) // block_size * block_size)
            continue
        chain, hit = 0, 0
        chains = []
        for m, h in enumerate(r.hash_ids, start=1):
            chain = hash((chain, h))
            chains.append((chain, min(m * block_tokens, r.input_len)))
            if hit == m - 1 and chain in covered:
                hit = m
        tokens = covered[chains[hit - 1][0]] if hit else 0
        out.append(min(tokens, r.input_len - 1) // block_size * block_size)
        for chain, held in chains:
            covered[chain] = max(covered.get(chain, 0), held)
    return out


def request_blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def working_set_blocks(requests: list[TraceRequest], block_tokens: int, block_size: int) -> int:
    """Engine blocks a cache needs to keep everything a trace computes
    (an upper bound): every distinct hash block, every request's tokens
    past its ids, and every answer's blocks."""
    distinct = len({h for r in requests for h in r.hash_ids}) * request_blocks(block_tokens, block_size)
    own = sum(request_blocks(max(0, r.input_len - len(r.hash_ids) * block_tokens), block_size) for r in requests)
    answers = sum(request_blocks(r.output_len, block_size) + 1 for r in requests)
    return distinct + own + answers


def longest_session_blocks(requests: list[TraceRequest], block_size: int) -> int:
    """Engine blocks of the longest request's prompt and answer."""
    return max(request_blocks(r.input_len + r.output_len, block_size) for r in requests)


def sessions_held(requests: list[TraceRequest], capped_blocks: int, block_size: int) -> int:
    """How many sessions' longest contexts a cache of ``capped_blocks`` holds at once."""
    return capped_blocks // longest_session_blocks(requests, block_size)


def sessions(requests: list[TraceRequest]) -> list[str]:
    """The trace's sessions, in order of first arrival."""
    return list(dict.fromkeys(r.session for r in requests))
