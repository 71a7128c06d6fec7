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
cost (an average of rates would hide it). Each tier's samples are also
fitted as a fixed cost per lookup plus a cost per token (:class:`LoadFit`),
which prices a whole claim where the scheduler states it (below).

Invariants:
    * With ``policy="always"`` every tier is asked for everything.
    * A tier never measured is asked for a probe only (``PROBE``: at most a
      few blocks, see the scheduler), so an unknown slow link costs a
      probe, not a prompt; a measured tier with the prefill cost still
      unmeasured is loaded (``LOAD``: the connector's behaviour before this
      model existed).
    * A tier is loaded from only if loading is expected to take less than
      computing: the claim priced whole by the fitted lines where there are
      some (next invariant), else one token from it (its own time plus the
      local tier's, where measured) against one computed; otherwise it is
      skipped (``SKIP``), except once every
      ``reprobe_interval_s`` (``PROBE``), so a recovered tier is noticed:
      the probe's measurement is a sample like any other.
    * Where the scheduler states the claim at stake (its tokens, and the
      lookups that bring it) and a tier's load times have been fitted as a
      fixed cost plus a cost per token (:class:`LoadFit`), the claim is
      priced whole: its fixed costs, once per lookup, count against it, so
      a short prompt is recomputed where a long one over the same link is
      loaded. Without a fit, seconds per token are compared.
    * Prefill samples come from steps that computed at least
      ``min_prefill_tokens`` tokens: a decode step's time is per-step
      overhead, not a prefill rate.
    * Where a claim is priced whole (previous invariant), its recompute is
      priced by the positions it computes if the prefill samples fit a
      cost per token rising with position (:class:`PrefillFit`:
      attention), else by the average per token. The line is fitted on
      whole steps, so a step's fixed overhead, spread over its tokens,
      flattens it: a skewed fit errs towards the average, never below 0.
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


@dataclass
class WeightedLine:
    """``y = intercept + slope * x`` by exponentially weighted least squares
    (each new sample keeps ``1 - weight`` of the old ones' weight).

    Invariants:
        * :meth:`fit` is None unless the ``x`` of the samples vary enough
          to tell the two terms apart (coefficient of variation at least
          :data:`MIN_SPREAD`).
    """

    weight: float = 0.15
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    #: The ``x`` of the samples must vary at least this much (std / mean).
    MIN_SPREAD = 0.25

    def add(self, x: float, y: float) -> None:
        keep = self._keep()
        w = self.weight
        self._w = keep * self._w + w
        self._x = keep * self._x + w * x
        self._y = keep * self._y + w * y
        self._xx = keep * self._xx + w * x * x
        self._xy = keep * self._xy + w * x * y

    def _keep(self) -> float:
        return 1.0 - self.weight if self._w else 0.0

    def fit(self) -> tuple[float, float] | None:
        """``(intercept, slope)``, or None while ``x`` varies too little."""
        if self._w <= 0 or self._x <= 0:
            return None
        mean_x = self._x / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x < (self.MIN_SPREAD * mean_x) ** 2:
            return None
        slope = (self._xy / self._w - mean_x * self._y / self._w) / var_x
        return self._y / self._w - slope * mean_x, slope

    def slope_through_origin(self) -> float:
        """The least-squares slope of ``y = slope * x`` (samples with x > 0 exist)."""
        return self._xy / self._xx


@dataclass
class LoadFit(WeightedLine):
    """Seconds to load ``n`` tokens from a tier, fitted as ``fixed_s +
    per_token_s * n`` over ``(tokens, seconds)`` samples. A lookup's fixed
    cost (round trips, a commit, a scheduling round) makes short loads
    dearer per token than long ones; a single rate cannot say that a
    1K-token load loses where an 8K-token one wins. Samples with no tokens
    (a lookup that found nothing) are kept: they pin the fixed cost.

    Invariants:
        * :meth:`line` is None unless :meth:`WeightedLine.fit` has a line,
          samples with tokens hold at least :data:`MIN_TOKEN_SHARE` of the
          weight, and the cost per token comes out positive; callers then
          fall back to the per-token average (:class:`Ewma`). A fixed cost
          fitted below zero is zero.
    """

    _w_tokens: float = 0.0  # weight of the samples that carried tokens

    #: Samples with tokens must hold at least this share of the weight: a
    #: long run of misses otherwise leaves a slope resting on hits whose
    #: weight has decayed to nothing.
    MIN_TOKEN_SHARE = 0.2

    def add(self, tokens: float, seconds: float) -> None:
        self._w_tokens = self._keep() * self._w_tokens + (self.weight if tokens > 0 else 0.0)
        super().add(tokens, seconds)

    def line(self) -> tuple[float, float] | None:
        """``(fixed_s, per_token_s)``, or None (see the invariants)."""
        fitted = self.fit() if self._w_tokens >= self.MIN_TOKEN_SHARE * self._w else None
        if fitted is None or fitted[1] <= 0:
            return None
        if fitted[0] < 0:  # no fixed cost to speak of (noise put it below 0): the line through the origin
            return 0.0, self.slope_through_origin()
        return fitted


@dataclass
class PrefillFit(WeightedLine):
    """The engine's seconds per computed token as a line in the token's
    position in its sequence, over ``(mean position, seconds per token)``
    samples of prefill steps. Attention reads every earlier token, so a
    token at position 8000 costs more than one at 1000: one average per
    token prices a short recompute too high (and loads it where computing
    is faster) and a long one too low.

    Invariants:
        * :meth:`line` is None unless :meth:`WeightedLine.fit` has a line
          with both terms positive; callers then use the average per token.
    """

    def line(self) -> tuple[float, float] | None:
        """``(seconds_per_token_at_0, seconds_per_token_per_position)``, or None."""
        fitted = self.fit()
        return fitted if fitted is not None and fitted[0] > 0 and fitted[1] > 0 else None


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
        self._prefill_fit = PrefillFit()  # its own decay, like each LoadFit (fewer, larger samples than the averages)
        self._load: dict[tuple[str, str], Ewma] = {}
        self._fits: dict[tuple[str, str], LoadFit] = {}
        self._last_asked_s: dict[tuple[str, str], float] = {}
        self.skipped: dict[str, int] = {tier: 0 for tier in TIERS}

    # -- measurements -------------------------------------------------------------
    def observe_prefill(self, tokens: int, seconds: float, mean_position: float | None = None) -> None:
        """A step computed ``tokens`` tokens in ``seconds`` (its own time,
        loads excluded), their mean position in their sequences
        ``mean_position`` where known; small steps are ignored (module
        invariants)."""
        if tokens >= self._min_prefill_tokens and seconds >= _MIN_SAMPLE_S:
            self.prefill.add(seconds / tokens)
            if mean_position is not None:
                self._prefill_fit.add(mean_position, seconds / tokens)

    def recompute_seconds(self, tokens: int, first_position: int = 0) -> float | None:
        """Expected seconds to compute ``tokens`` tokens from position
        ``first_position`` on: by the fitted line in position where there
        is one (:class:`PrefillFit`), else by the average per token; None
        while prefill is unmeasured."""
        line = self._prefill_fit.line()
        if line is not None:
            return tokens * (line[0] + line[1] * (first_position + (tokens - 1) / 2))
        return None if self.prefill.value is None else tokens * self.prefill.value

    def observe_load(self, namespace: str, tier: str, tokens: int, seconds: float) -> None:
        """``tokens`` tokens of ``namespace`` came from ``tier`` in
        ``seconds`` (a sample with no tokens says nothing of the rate, but
        still counts as asking the tier)."""
        _check_tier(tier)
        self._last_asked_s[(namespace, tier)] = self._clock()
        if tokens > 0 and seconds >= _MIN_SAMPLE_S:
            self._load.setdefault((namespace, tier), Ewma(self._weight)).add(seconds / tokens)
        if tokens >= 0 and seconds >= _MIN_SAMPLE_S:  # a lookup that asked nothing is no sample
            self._fits.setdefault((namespace, tier), LoadFit()).add(tokens, seconds)

    def load_line(self, namespace: str, tier: str) -> tuple[float, float] | None:
        """``(fixed_s, per_token_s)`` of ``tier``'s fitted load time, None
        while the samples cannot tell the two apart (:class:`LoadFit`)."""
        _check_tier(tier)
        fit = self._fits.get((namespace, tier))
        return None if fit is None else fit.line()

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

    def claim_seconds(self, namespace: str, tier: str, tokens: int, lookups: int = 1) -> float | None:
        """Expected seconds to load a claim of ``tokens`` tokens from
        ``tier`` in ``lookups`` timed lookups, by the fitted lines (a remote
        claim also passes through the local tier); None where a tier on the
        way has no fit (:meth:`load_line`)."""
        line = self.load_line(namespace, tier)
        if line is None:
            return None
        total_s = lookups * line[0] + tokens * line[1]
        if tier == "remote":
            local = self.load_line(namespace, "local")
            if local is not None:
                total_s += local[0] + tokens * local[1]
            else:  # no local fit: its average per token, where measured
                total_s += tokens * (self.seconds_per_token(namespace, "local") or 0.0)
        return total_s

    def faster_than_recompute(
        self, namespace: str, tier: str, tokens: int | None = None, lookups: int = 1, first_position: int = 0,
    ) -> bool:
        """True if loading from ``tier`` is expected to beat recomputing,
        or cannot be judged yet (either cost unmeasured), or the policy is
        "always". Given the claim's ``tokens`` from ``first_position`` on
        (and the ``lookups`` that bring it), a fitted fixed cost is counted
        once per lookup (:meth:`claim_seconds`) against the recompute of
        those positions (:meth:`recompute_seconds`); otherwise, or while
        there is no fit, seconds per token are compared."""
        if self.policy == "always" or self.prefill.value is None:
            return True
        if tokens:
            claim_s = self.claim_seconds(namespace, tier, tokens, lookups)
            recompute_s = self.recompute_seconds(tokens, first_position)
            if claim_s is not None and recompute_s is not None:
                return claim_s < recompute_s
        load_s = self.seconds_per_token(namespace, tier)
        return load_s is None or load_s < self.prefill.value

    def decide(
        self, namespace: str, tier: str, *, probe_unmeasured: bool = True, tokens: int | None = None, lookups: int = 1,
        first_position: int = 0,
    ) -> Decision:
        """What to ask ``tier`` for now (module invariants); a skip is
        counted in :attr:`skipped`. ``probe_unmeasured=False`` loads an
        unmeasured tier in full (the local tier: its loads are timed
        anyway, and its first one is no gamble). ``tokens``, ``lookups``
        and ``first_position`` describe the claim at stake
        (:meth:`faster_than_recompute`)."""
        if self.policy == "always":
            return Decision.LOAD
        if self.seconds_per_token(namespace, tier) is None:
            return Decision.PROBE if probe_unmeasured else Decision.LOAD
        if self.faster_than_recompute(namespace, tier, tokens, lookups, first_position):
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
        """Current estimates (logs, benchmarks): rates in tokens per second,
        fixed costs in seconds, the prefill line in seconds per token."""
        lines = {tier: self.load_line(namespace, tier) for tier in TIERS}
        prefill_line = self._prefill_fit.line()
        return {"prefill_tokens_per_s": self.prefill.rate,
                "prefill_s_per_token_at_0": None if prefill_line is None else prefill_line[0],
                "prefill_s_per_token_per_position": None if prefill_line is None else prefill_line[1],
                **{f"{tier}_tokens_per_s": self.load_rate(namespace, tier) for tier in TIERS},
                **{f"{tier}_fixed_s": None if line is None else line[0] for tier, line in lines.items()},
                **{f"{tier}_fitted_tokens_per_s": None if line is None else 1.0 / line[1] for tier, line in lines.items()}}


def _check_tier(tier: str) -> None:
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
