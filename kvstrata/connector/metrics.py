"""What the tiers are worth: per request and per tier, the tokens that came
from the store, the time loading them took, and the time that saved against
recomputing them.

The recompute estimate is the model's measured prefill cost per token (an
exponential average over steps that computed at least ``MIN_TOKENS`` tokens,
taken from the worker's reports) times the hit tokens, minus the load time.
Counters are kept per event and read as a flat dict (``EngineStats.extra``).
"""

from __future__ import annotations

from collections import deque

import msgspec

MIN_TOKENS = 32
_ALPHA = 0.2


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

    __slots__ = ("tiers", "hit_tokens", "load_s", "saved_s", "s_per_token", "requests",
                 "counters")

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
                "blend_requests", "blend_segment_hits", "blend_segment_misses", "blend_failed")

    def __init__(self, tier_names: list[str], keep: int = 1024) -> None:
        self.tiers = list(tier_names)
        self.hit_tokens = dict.fromkeys(self.tiers, 0)
        self.load_s = dict.fromkeys(self.tiers, 0.0)
        self.saved_s = dict.fromkeys(self.tiers, 0.0)
        self.s_per_token: float | None = None
        self.requests: deque[RequestTransferStats] = deque(maxlen=keep)
        self.counters = dict.fromkeys(self.COUNTERS, 0)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def observe_forward(self, seconds: float, tokens: int) -> None:
        if tokens < MIN_TOKENS or seconds <= 0:
            return
        per = seconds / tokens
        old = self.s_per_token
        self.s_per_token = per if old is None else old + _ALPHA * (per - old)

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

    def as_dict(self, prefix: str = "connector") -> dict[str, float]:
        out = {f"{prefix}.{k}": float(v) for k, v in self.counters.items()}
        for tier in self.hit_tokens:
            out[f"{prefix}.{tier}.hit_tokens"] = float(self.hit_tokens[tier])
            out[f"{prefix}.{tier}.load_s"] = self.load_s[tier]
            out[f"{prefix}.{tier}.saved_s_est"] = self.saved_s[tier]
        if self.s_per_token is not None:
            out[f"{prefix}.recompute_s_per_token"] = self.s_per_token
            out[f"{prefix}.prefill_tokens_per_s"] = 1.0 / self.s_per_token
        return out
