"""Load-or-recompute cost model of the connector's scheduler side.

It keeps two kinds of measured cost, both in seconds per token so they
compare directly: the engine's prefill cost (a step's round trip, less the
connector's own load and lookup time in it, over the tokens it computed)
and, per namespace and tier, the cost of bringing stored KV into the paged
cache: ``"remote"`` from the scheduler's timed lookups that promote remote
blocks into the local tier, ``"local"`` from the workers' timed loads, fed
back through vLLM's ``update_connector_output`` (scheduler.py). Each is an
exponentially weighted moving average of seconds per token, not of rates:
one slow sample among fast ones moves the estimate as much as the time it
cost (an average of rates would hide it).

Invariants:
    * With ``policy="always"`` every tier is asked for everything.
    * A tier never measured is asked for a probe only (``PROBE``: at most a
      few blocks, see the scheduler), so an unknown slow link costs a
      probe, not a prompt; a measured tier with the prefill cost still
      unmeasured is loaded (``LOAD``: the connector's behaviour before this
      model existed).
    * A tier is loaded from only if one token from it (its own time plus
      the local tier's, where measured) is expected to take less than
      computing it; otherwise it is skipped (``SKIP``), except once every
      ``reprobe_interval_s`` (``PROBE``), so a recovered tier is noticed:
      the probe's measurement is a sample like any other.
    * Prefill samples come from steps that computed at least
      ``min_prefill_tokens`` tokens: a decode step's time is per-step
      overhead, not a prefill rate.
    * Pure Python, no vLLM or torch imports: the scheduler feeds it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

from ucm_db.errors import ConfigError

#: Values of the ``load_policy`` connector setting.
LOAD_POLICIES = ("auto", "always")
TIERS = ("local", "remote")

#: Samples shorter than this are timer noise, not a rate.
_MIN_SAMPLE_S = 1e-4
#: Steps computing fewer tokens than this say nothing of the prefill rate.
MIN_PREFILL_TOKENS = 256


class Decision(enum.Enum):
    """What to ask a tier for (see the module invariants)."""

    LOAD = "load"    # everything it holds
    PROBE = "probe"  # a few blocks, to measure it
    SKIP = "skip"    # nothing: recomputing is expected faster


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
    """Exponentially weighted moving average of seconds per token;
    ``value`` is None until the first sample."""

    weight: float = 0.3
    value: float | None = None
    samples: int = 0

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else (1 - self.weight) * self.value + self.weight * sample
        self.samples += 1

    @property
    def rate(self) -> float | None:
        """Tokens per second, None if unmeasured."""
        return None if self.value is None else 1.0 / self.value


class CostModel:
    """Measured prefill and load costs, and the decisions made from them
    (see the module invariants)."""

    def __init__(
        self, policy: str = "auto", *, weight: float = 0.3, reprobe_interval_s: float = 30.0,
        min_prefill_tokens: int = MIN_PREFILL_TOKENS, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = check_load_policy(policy)
        self._weight = weight
        self._reprobe_interval_s = reprobe_interval_s
        self._min_prefill_tokens = min_prefill_tokens
        self._clock = clock
        self.prefill = Ewma(weight)
        self._load: dict[tuple[str, str], Ewma] = {}
        self._last_asked_s: dict[tuple[str, str], float] = {}
        self.skipped: dict[str, int] = {tier: 0 for tier in TIERS}

    # -- measurements -------------------------------------------------------------
    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step computed ``tokens`` tokens in ``seconds`` (its own time,
        loads excluded); small steps are ignored (module invariants)."""
        if tokens >= self._min_prefill_tokens and seconds >= _MIN_SAMPLE_S:
            self.prefill.add(seconds / tokens)

    def observe_load(self, namespace: str, tier: str, tokens: int, seconds: float) -> None:
        """``tokens`` tokens of ``namespace`` came from ``tier`` in
        ``seconds`` (a sample with no tokens says nothing of the rate, but
        still counts as asking the tier)."""
        _check_tier(tier)
        self._last_asked_s[(namespace, tier)] = self._clock()
        if tokens > 0 and seconds >= _MIN_SAMPLE_S:
            self._load.setdefault((namespace, tier), Ewma(self._weight)).add(seconds / tokens)

    def load_rate(self, namespace: str, tier: str) -> float | None:
        """Measured tokens per second from ``tier``, None if unmeasured."""
        _check_tier(tier)
        ewma = self._load.get((namespace, tier))
        return None if ewma is None else ewma.rate

    # -- decisions ----------------------------------------------------------------
    def seconds_per_token(self, namespace: str, tier: str) -> float | None:
        """Expected seconds to load one token from ``tier`` into the paged
        cache (a remote token also passes through the local tier, where
        that is measured); None if ``tier`` is unmeasured."""
        _check_tier(tier)
        ewma = self._load.get((namespace, tier))
        if ewma is None or ewma.value is None:
            return None
        local = self._load.get((namespace, "local")) if tier == "remote" else None
        return ewma.value + (local.value if local is not None and local.value is not None else 0.0)

    def faster_than_recompute(self, namespace: str, tier: str) -> bool:
        """True if loading from ``tier`` is expected to beat recomputing,
        or cannot be judged yet (either cost unmeasured), or the policy is
        "always"."""
        if self.policy == "always" or self.prefill.value is None:
            return True
        load_s = self.seconds_per_token(namespace, tier)
        return load_s is None or load_s < self.prefill.value

    def decide(self, namespace: str, tier: str, *, probe_unmeasured: bool = True) -> Decision:
        """What to ask ``tier`` for now (module invariants); a skip is
        counted in :attr:`skipped`. ``probe_unmeasured=False`` loads an
        unmeasured tier in full (the local tier: its loads are timed
        anyway, and its first one is no gamble)."""
        if self.policy == "always":
            return Decision.LOAD
        if self.seconds_per_token(namespace, tier) is None:
            return Decision.PROBE if probe_unmeasured else Decision.LOAD
        if self.faster_than_recompute(namespace, tier):
            return Decision.LOAD
        last_s = self._last_asked_s.get((namespace, tier), float("-inf"))
        if self._clock() - last_s >= self._reprobe_interval_s:
            self._last_asked_s[(namespace, tier)] = self._clock()  # one probe per interval, even if it finds nothing
            return Decision.PROBE
        self.skipped[tier] += 1
        return Decision.SKIP

    def should_ask(self, namespace: str, tier: str) -> bool:
        """Whether to ask ``tier`` at all now (a probe counts)."""
        return self.decide(namespace, tier) is not Decision.SKIP

    def describe(self, namespace: str) -> dict[str, float | None]:
        """Current estimates in tokens per second (logs, benchmarks)."""
        return {"prefill_tokens_per_s": self.prefill.rate,
                **{f"{tier}_tokens_per_s": self.load_rate(namespace, tier) for tier in TIERS}}


def _check_tier(tier: str) -> None:
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
