"""Load-or-recompute cost model of the connector's scheduler side.

It keeps two measured rates, both in tokens per second so they compare
directly: the engine's prefill rate (tokens scheduled per step over the
step's seconds) and, per namespace and tier (``"local"``, ``"remote"``),
the rate at which stored KV reached the local tier (tokens promoted from
the remote per second of the lookup that promoted them). Each is an
exponentially weighted moving average of its samples.

Invariants:
    * Until both rates of a decision are measured, it loads (the
      connector's behaviour before this model existed); with
      ``policy="always"`` it always loads.
    * A tier is worth asking only if loading one token from it (its own
      time plus the local tier's, where measured) is expected to take less
      than computing it.
    * A tier judged slower than recompute is asked again at most every
      ``reprobe_interval_s`` seconds, so a recovered tier is noticed: the
      probe's measurement replaces the estimate's weight like any sample.
    * Pure Python, no vLLM or torch imports: the scheduler feeds it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ucm_db.errors import ConfigError

#: Values of the ``load_policy`` connector setting.
LOAD_POLICIES = ("auto", "always")
TIERS = ("local", "remote")

#: Samples shorter than this are timer noise, not a rate.
_MIN_SAMPLE_S = 1e-4


def check_load_policy(policy: object) -> str:
    """``policy`` if valid, else :class:`~ucm_db.errors.ConfigError`."""
    if policy not in LOAD_POLICIES:
        raise ConfigError(
            f"load_policy must be one of {', '.join(LOAD_POLICIES)}, got {policy!r}",
            hint="use load_policy='auto' (measured load vs recompute) or 'always' to debug loads",
        )
    return str(policy)


@dataclass
class Ewma:
    """Exponentially weighted moving average of rates; ``value`` is None
    until the first sample."""

    weight: float = 0.3
    value: float | None = None
    samples: int = 0

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else (1 - self.weight) * self.value + self.weight * sample
        self.samples += 1


class CostModel:
    """Measured prefill and load rates, and the decisions made from them
    (see the module invariants)."""

    def __init__(
        self, policy: str = "auto", *, weight: float = 0.3, reprobe_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = check_load_policy(policy)
        self._weight = weight
        self._reprobe_interval_s = reprobe_interval_s
        self._clock = clock
        self.prefill = Ewma(weight)
        self._load: dict[tuple[str, str], Ewma] = {}
        self._last_asked_s: dict[tuple[str, str], float] = {}
        self.skipped: dict[str, int] = {tier: 0 for tier in TIERS}

    # -- measurements -------------------------------------------------------------
    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step computed ``tokens`` tokens in ``seconds``."""
        if tokens > 0 and seconds >= _MIN_SAMPLE_S:
            self.prefill.add(tokens / seconds)

    def observe_load(self, namespace: str, tier: str, tokens: int, seconds: float) -> None:
        """``tokens`` tokens of ``namespace`` came from ``tier`` in
        ``seconds`` (a sample with no tokens says nothing of the rate)."""
        _check_tier(tier)
        self._last_asked_s[(namespace, tier)] = self._clock()
        if tokens > 0 and seconds >= _MIN_SAMPLE_S:
            self._load.setdefault((namespace, tier), Ewma(self._weight)).add(tokens / seconds)

    def load_rate(self, namespace: str, tier: str) -> float | None:
        """Measured tokens per second from ``tier``, None if unmeasured."""
        _check_tier(tier)
        ewma = self._load.get((namespace, tier))
        return None if ewma is None else ewma.value

    # -- decisions ----------------------------------------------------------------
    def seconds_per_token(self, namespace: str, tier: str) -> float | None:
        """Expected seconds to load one token from ``tier`` into the paged
        cache (a remote token also passes through the local tier, where
        that is measured); None if ``tier`` is unmeasured."""
        rate = self.load_rate(namespace, tier)
        if rate is None:
            return None
        seconds = 1.0 / rate
        local = self.load_rate(namespace, "local") if tier == "remote" else None
        return seconds + (1.0 / local if local else 0.0)

    def faster_than_recompute(self, namespace: str, tier: str) -> bool:
        """True if loading from ``tier`` is expected to beat recomputing,
        or cannot be judged yet (unmeasured), or the policy is "always"."""
        if self.policy == "always" or self.prefill.value is None:
            return True
        load_s = self.seconds_per_token(namespace, tier)
        return load_s is None or load_s < 1.0 / self.prefill.value

    def should_ask(self, namespace: str, tier: str) -> bool:
        """Whether to look ``tier`` up now: it is expected faster than
        recompute, or it was judged slower and its re-probe is due."""
        if self.faster_than_recompute(namespace, tier):
            return True
        last_s = self._last_asked_s.get((namespace, tier), float("-inf"))
        if self._clock() - last_s >= self._reprobe_interval_s:
            return True
        self.skipped[tier] += 1
        return False


def _check_tier(tier: str) -> None:
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
