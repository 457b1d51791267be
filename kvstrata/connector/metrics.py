"""What the tiers are worth: per request and per tier, the tokens that came
from the store, the time loading them took, and the time that saved against
recomputing them.

The recompute estimate is the model's measured prefill cost per token
times the hit tokens, minus the load time. The cost of a step is fitted
online as ``step_s + s_per_token * tokens`` (exponentially weighted least
squares over the worker's reports of every step that computed tokens): the
slope is the marginal cost of a token, the intercept what any step costs
(launches, sampling, the loop), which the load-or-compute split pays once
more when it computes a request's front in a step of its own.
Counters are kept per event and read as a flat dict (``EngineStats.extra``).
"""

from __future__ import annotations

from collections import deque

import msgspec

_ALPHA = 0.2  # weight of the newest step in the fit (alone: 1 / _ALPHA steps of memory)


class StepCostFit:
    """Owns: exponentially weighted sums of (tokens, seconds) of recent
    steps; ``fit()`` gives (seconds per step, seconds per token)."""

    __slots__ = ("n", "st", "ss", "stt", "sts")

    def __init__(self) -> None:
        self.n = self.st = self.ss = self.stt = self.sts = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        keep = 1.0 - _ALPHA
        t = float(tokens)
        self.n = self.n * keep + 1.0
        self.st = self.st * keep + t
        self.ss = self.ss * keep + seconds
        self.stt = self.stt * keep + t * t
        self.sts = self.sts * keep + t * seconds

    def fit(self) -> tuple[float, float] | None:
        """(intercept, slope); None before any step. Steps all of one size
        give no slope apart from the intercept: then all of it is per token."""
        if self.n <= 0 or self.st <= 0:
            return None
        var = self.n * self.stt - self.st * self.st
        if var <= 1e-9 * self.n * self.stt:
            return 0.0, self.ss / self.st
        slope = (self.n * self.sts - self.st * self.ss) / var
        intercept = (self.ss - slope * self.st) / self.n
        if slope <= 0:
            return 0.0, self.ss / self.st
        if intercept < 0:
            return 0.0, self.sts / self.stt
        return intercept, slope


class RequestTransferStats(msgspec.Struct, frozen=True, kw_only=True):
    """One finished request: tokens loaded from each tier, load seconds
    (fetch wall time for asynchronous loads plus the copies into the device
    cache), and the estimated seconds the hit saved."""

    request_id: str
    hit_tokens: int = 0
    hit_tokens_by_tier: dict[str, int] = {}
    load_s: float = 0.0
    saved_s_est: float = 0.0
    failed_tokens: int = 0


class TransferMetrics:
    """Owns: the connector's counters, the per-tier totals, the recompute
    cost estimate and the last ``keep`` per-request records. Loop only."""

    __slots__ = ("tiers", "hit_tokens", "load_s", "saved_s", "s_per_token", "step_s", "requests",
                 "counters", "_fit")

    # query_tokens: prompt tokens past the device hit that a finished
    # request's last lookup asked the store about: the denominator of every
    # tier's hit rate, whose numerator is that tier's hit_tokens.
    COUNTERS = ("lookups", "query_tokens", "lookup_hit_chunks", "requests_with_hits", "load_chunks",
                "load_failed_tokens", "saved_chunks", "dropped_saves", "skipped_saves", "async_loads", "sync_loads",
                # load or compute (costs.py): hits read from a lower tier loaded whole,
                # split (front computed while the back loads), computed whole; splits
                # whose computing reached the end of the hit before the fetch landed
                "split_load_only", "split_loads", "split_compute_only", "split_fetch_outrun",
                # CacheBlend: requests blended, their segments found in the store or computed
                "blend_requests", "blend_segment_hits", "blend_segment_misses")

    def __init__(self, tier_names: list[str], keep: int = 1024) -> None:
        self.tiers = list(tier_names)
        self.hit_tokens = dict.fromkeys(self.tiers, 0)
        self.load_s = dict.fromkeys(self.tiers, 0.0)
        self.saved_s = dict.fromkeys(self.tiers, 0.0)
        self.s_per_token: float | None = None  # marginal prefill seconds per token (the fit's slope)
        self.step_s = 0.0  # seconds any step costs (the fit's intercept)
        self._fit = StepCostFit()
        self.requests: deque[RequestTransferStats] = deque(maxlen=keep)
        self.counters = dict.fromkeys(self.COUNTERS, 0)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def observe_forward(self, seconds: float, tokens: int) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self._fit.observe(tokens, seconds)
        fit = self._fit.fit()
        if fit is not None:
            self.step_s, self.s_per_token = fit

    def request_done(self, request_id: str, by_tier: dict[str, int], load_s: float,
                     failed_tokens: int) -> RequestTransferStats:
        """Book one request's hit into the per-tier totals (load time split by tokens)."""
        hit = sum(by_tier.values())
        per = self.s_per_token or 0.0
        saved = max(0.0, hit * per - load_s) if hit else 0.0
        for tier, tokens in by_tier.items():
            share = tokens / hit if hit else 0.0
            self.hit_tokens[tier] = self.hit_tokens.get(tier, 0) + tokens
            self.load_s[tier] = self.load_s.get(tier, 0.0) + load_s * share
            self.saved_s[tier] = self.saved_s.get(tier, 0.0) + saved * share
        if hit:
            self.counters["requests_with_hits"] += 1
        rec = RequestTransferStats(request_id=request_id, hit_tokens=hit, hit_tokens_by_tier=dict(by_tier),
                                   load_s=load_s, saved_s_est=saved, failed_tokens=failed_tokens)
        self.requests.append(rec)
        return rec

    def total_hit_tokens(self) -> int:
        """Every tier's hit tokens together (each hit is booked once, when its request finishes)."""
        return sum(self.hit_tokens.values())

    def as_dict(self, prefix: str = "connector") -> dict[str, float]:
        out = {f"{prefix}.{k}": float(v) for k, v in self.counters.items()}
        for tier in self.hit_tokens:
            out[f"{prefix}.{tier}.hit_tokens"] = float(self.hit_tokens[tier])
            out[f"{prefix}.{tier}.load_s"] = self.load_s[tier]
            out[f"{prefix}.{tier}.saved_s_est"] = self.saved_s[tier]
        if self.s_per_token is not None:
            out[f"{prefix}.recompute_s_per_token"] = self.s_per_token
            out[f"{prefix}.prefill_tokens_per_s"] = 1.0 / self.s_per_token
            out[f"{prefix}.step_overhead_s"] = self.step_s
        return out
