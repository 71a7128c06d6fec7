"""The serving benchmark's conversation workload (issue 29, item 5): the
seeded conversations and the prefix-hit accounting, pure functions that
need no engine (:mod:`.serve_chat_client` sends them, :mod:`.serve_chat`
runs the rows).

A conversation of ``turns`` turns is user messages ``u1 .. uT`` of
``turn_tokens`` tokens and assistant blocks ``a1 .. a(T-1)`` of
``output_tokens`` tokens; turn ``k``'s prompt is the conversation so far,
``u1 a1 u2 a2 .. uk``, and the engine answers it with ``output_tokens``
tokens. Multi-turn chat grows a chain a turn at a time this way, which
``prefix_repetition`` never does.

The assistant blocks are fixed seeded tokens, not the engine's answers fed
back (a decision, issue 29 item 5 left it open): the random-weight model's
greedy answers depend on what else is in the batch, so fed-back answers
would give each row and each pass other prompts, and their prefix hits
would not compare. The block has the answer's length, so prompts grow as a
real chat's do; the price is that the KV vLLM computed while decoding an
answer is never reused (in any row alike), so a turn's reusable prefix is
the previous turn's prompt (:func:`reusable_tokens`).

Invariants:
    * The same spec gives the same token ids (numpy's seeded generator);
      ids are never the tokenizer's special ids (0..3).
    * Turn ``k + 1``'s prompt starts with turn ``k``'s prompt.
    * Hit accounting is differences of counters read from the server's
      ``/metrics`` before and after a pass; a row's "recovered hits" is
      (vLLM's own prefix-cache hits + ucm-db's hit tokens) over its bound's
      vLLM prefix-cache hits, computed from this run's figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ucm_db.tools.bench.serve_model import SPECIAL_TOKENS, VOCAB_SIZE

#: vLLM's own prefix-cache counters (Prometheus names less ``vllm:`` and ``_total``).
VLLM_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries",
                 "external_prefix_cache_hits")


@dataclass(frozen=True)
class ConversationSpec:
    """What the conversation workload sends."""

    conversations: int = 16
    turns: int = 4
    turn_tokens: int = 256
    output_tokens: int = 16
    concurrency: int = 4
    seed: int = 7

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "turn_tokens", "output_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"ConversationSpec.{name} must be at least 1, not {getattr(self, name)}")

    @property
    def num_requests(self) -> int:
        return self.conversations * self.turns

    @property
    def last_prompt_tokens(self) -> int:
        """The longest prompt: the last turn's."""
        return self.turns * self.turn_tokens + (self.turns - 1) * self.output_tokens

    @property
    def request_tokens(self) -> int:
        """The longest request's context: the last prompt and its answer."""
        return self.last_prompt_tokens + self.output_tokens

    def working_set_blocks(self, block_size: int) -> int:
        """Blocks of every conversation's longest context (what a bound must hold)."""
        return self.conversations * -(-self.request_tokens // block_size)


def conversations(spec: ConversationSpec) -> list[list[list[int]]]:
    """Every conversation's turn prompts: ``result[c][k]`` is conversation
    ``c``'s turn ``k`` prompt (token ids), seeded by ``spec.seed``."""
    rng = np.random.default_rng(spec.seed)
    low = len(SPECIAL_TOKENS)
    out: list[list[list[int]]] = []
    for _ in range(spec.conversations):
        so_far: list[int] = []
        prompts: list[list[int]] = []
        for turn in range(spec.turns):
            if turn:
                so_far += rng.integers(low, VOCAB_SIZE, spec.output_tokens).tolist()  # the assistant block
            so_far += rng.integers(low, VOCAB_SIZE, spec.turn_tokens).tolist()  # the user's message
            prompts.append(list(so_far))
        out.append(prompts)
    return out


def reusable_tokens(prompt_tokens: int, previous_prompt_tokens: int, block_size: int) -> int:
    """Tokens of a prompt that a cache holding the previous prompts can
    serve: whole blocks of the previous turn's prompt (0 for a first turn),
    never the prompt's last token (vLLM always computes it)."""
    return min(previous_prompt_tokens // block_size, (prompt_tokens - 1) // block_size) * block_size


def ideal_hits(spec: ConversationSpec, block_size: int, *, warm: bool) -> int:
    """Prefix-hit tokens of one pass with a cache that forgets nothing: a
    first pass reuses each turn's previous prompt; a second pass of the same
    prompts reuses every prompt's own whole blocks (last token excepted)."""
    total = 0
    for turn in range(spec.turns):
        tokens = (turn + 1) * spec.turn_tokens + turn * spec.output_tokens
        previous = tokens if warm else turn * spec.turn_tokens + max(turn - 1, 0) * spec.output_tokens
        total += reusable_tokens(tokens, previous, block_size)
    return total * spec.conversations


def parse_vllm_counters(text: str) -> dict[str, float]:
    """vLLM's prefix-cache counters in a Prometheus text page, summed over
    their labels: ``{"prefix_cache_hits": ..., ...}`` (missing ones absent)."""
    wanted = {f"vllm:{name}_total": name for name in VLLM_COUNTERS}
    counters: dict[str, float] = {}
    for line in text.splitlines():
        name_labels, _, value = line.rpartition(" ")
        key = wanted.get(name_labels.split("{", 1)[0])
        if key is None:
            continue
        try:
            counters[key] = counters.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return counters


def pass_hits(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The prefix-cache tokens of one pass (counter differences): vLLM's
    own queries and hits, the connector's hits as vLLM counts them
    (``external_*``) and as ucm-db counts them (``ucm_hit_tokens``, from
    the ``vllm:ucm_db_hit_tokens`` counter, merged into the same dicts)."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)
    return {"vllm_queries": delta("prefix_cache_queries"), "vllm_hits": delta("prefix_cache_hits"),
            "external_hits": delta("external_prefix_cache_hits"), "ucm_hit_tokens": delta("hit_tokens")}


def recovered_hits(row: dict[str, float], bound: dict[str, float]) -> float:
    """A row's prefix hits (vLLM's own plus ucm-db's) over its bound's
    vLLM hits; 1.0 when the bound had none to recover (nothing was lost)."""
    if bound["vllm_hits"] <= 0:
        return 1.0
    return (row["vllm_hits"] + row["ucm_hit_tokens"]) / bound["vllm_hits"]
