"""Replica load as the router sees it, the rule that skips hot replicas, and
the measures of a placement the benchmarks report: TTFT wait against each
request's own prefill, balance over windows, and the routing goals."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class ReplicaLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One replica's outstanding work, as the server last knew it:
    prompt tokens waiting for prefill, and requests decoding."""

    queued_prefill_tokens: int = 0
    running_requests: int = 0

    def cost(self, decode_weight: float) -> float:
        """In prefill-token equivalents: ``decode_weight`` per running request."""
        return self.queued_prefill_tokens + decode_weight * self.running_requests


def overloaded(costs: Sequence[float], factor: float, min_cost: float) -> list[bool]:
    """Which replicas to skip: load above ``factor`` times the mean and
    above ``min_cost`` (so idle clusters never skip on noise). With
    ``factor >= 1`` the least-loaded replica is never skipped."""
    if not costs:
        return []
    limit = max(factor * sum(costs) / len(costs), min_cost)
    return [c > limit for c in costs]


# -- measures of a placement (the benchmarks' and the fleet's) ------------------------


def percentile(xs: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q < 1) of ``xs``; NaN when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(int(q * len(s)), len(s) - 1)]


def worst_window_balance(dispatches: Sequence[tuple[float, str, float]], replicas: Sequence[str],
                         window_s: float) -> dict:
    """Balance of the work dispatched to ``replicas``: over every window
    ``(s - window_s, s]`` inside the run (from the first dispatch to the
    last; the whole run when it is shorter than ``window_s``), the max over
    the mean of the prefill tokens each replica was sent. ``dispatches``:
    ``(time, replica, tokens)``. The content of a window changes only when
    a dispatch enters (``s = t``) or leaves (``s = t + window_s``), so those
    are the ends examined. Returns the worst ratio, that window's end and
    tokens per replica, and how many windows were examined."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s!r}")
    if not dispatches or not replicas:
        return {"max_over_mean": None, "windows": 0}
    ds = sorted(dispatches, key=lambda d: d[0])
    slot = {r: i for i, r in enumerate(replicas)}
    sums = [0.0] * len(replicas)
    first, last = ds[0][0], ds[-1][0]
    lo_end = min(first + window_s, last)  # the whole run when shorter than a window
    ends = sorted({t for t, _, _ in ds} | {t + window_s for t, _, _ in ds})
    enter = leave = windows = 0
    worst: tuple[float, float, list[float]] | None = None
    for s in ends:
        if s > last:
            break
        while enter < len(ds) and ds[enter][0] <= s:
            sums[slot[ds[enter][1]]] += ds[enter][2]
            enter += 1
        while ds[leave][0] + window_s <= s:  # as computed for its end: exact in floats
            sums[slot[ds[leave][1]]] -= ds[leave][2]
            leave += 1
        if s < lo_end:
            continue
        windows += 1
        mean = sum(sums) / len(sums)
        if mean > 0 and (worst is None or max(sums) / mean > worst[0]):
            worst = (max(sums) / mean, s, list(sums))
    if worst is None:
        return {"max_over_mean": None, "windows": windows}
    ratio, end, sums = worst
    inside = [tokens for t, _, tokens in ds if end - window_s < t <= end or lo_end == last]
    # How far one dispatch moves the ratio there: prompts this large make 1.25 a matter of granularity.
    return {"max_over_mean": round(ratio, 3), "windows": windows, "worst_window_end_s": round(end, 3),
            "worst_window_tokens": {r: round(sums[i], 1) for r, i in slot.items()},
            "worst_window_largest_dispatch_over_mean": round(max(inside) / (sum(sums) / len(sums)), 3)}


def wait_summary(ttft: Sequence[float], own_prefill: Sequence[float]) -> dict:
    """TTFT against each request's own prefill on an idle replica: wait =
    TTFT - own (time spent behind other work; below 0 where a cache hit
    saved more than the queue cost), slowdown = TTFT / own; p50 / p99."""
    if len(ttft) != len(own_prefill):
        raise ValueError(f"{len(ttft)} TTFTs but {len(own_prefill)} own prefills")
    if any(o <= 0 for o in own_prefill):
        raise ValueError("own prefill times must be > 0")
    wait = [t - o for t, o in zip(ttft, own_prefill)]
    slow = [t / o for t, o in zip(ttft, own_prefill)]
    return {"wait_p50_s": round(percentile(wait, 0.5), 4), "wait_p99_s": round(percentile(wait, 0.99), 4),
            "slowdown_p50": round(percentile(slow, 0.5), 3), "slowdown_p99": round(percentile(slow, 0.99), 3)}


def routing_goals(kv: dict, round_robin: dict, least_loaded: dict, big: dict) -> dict:
    """Issue 24 §1's goals at one offered load, each with the figures it
    compares and whether it holds. Each policy's figures: ``wait_p99_s``,
    ``wait_p50_s``, ``ttft_p50_s``, ``prefix_hit_rate``, and for kv
    ``balance`` (:func:`worst_window_balance`'s). ``big``: the single big
    cache (one pool and one queue over the fleet's compute). The ``bound_``
    entries are the measurements that limit what routing can reach: the
    single big cache's TTFT p50 over round-robin's and its wait p99 over
    least-loaded's (no placement beats one pool with one queue), and the
    share of kv's TTFT p50 that is its own prefill."""

    def check(x: float, ref: float, bound: float, op: str = "<=") -> dict:
        met = x <= bound * ref if op == "<=" else x >= bound * ref
        return {"kv": x, "ref": ref, "ratio": round(x / ref, 3) if ref > 0 else None,
                "goal": f"{op} {round(bound, 3)}", "met": met}

    def ratio(x: float, ref: float) -> float | None:
        return round(x / ref, 3) if ref > 0 else None

    bal = kv["balance"]["max_over_mean"] if kv.get("balance") else None
    return {
        "wait_p99_vs_round_robin": check(kv["wait_p99_s"], round_robin["wait_p99_s"], 1 / 3),
        "wait_p99_vs_least_loaded": check(kv["wait_p99_s"], least_loaded["wait_p99_s"], 1 / 2),
        "wait_p99_vs_single_big_cache": check(kv["wait_p99_s"], big["wait_p99_s"], 1.25),
        "ttft_p50_vs_round_robin": check(kv["ttft_p50_s"], round_robin["ttft_p50_s"], 1 / 3),
        "hit_vs_single_big_cache": check(kv["prefix_hit_rate"], big["prefix_hit_rate"], 0.95, ">="),
        "balance_worst_window": {"kv": bal, "goal": "<= 1.25", "met": bal is not None and bal <= 1.25},
        "bound_single_big_cache_ttft_p50_vs_round_robin": ratio(big["ttft_p50_s"], round_robin["ttft_p50_s"]),
        "bound_single_big_cache_wait_p99_vs_least_loaded": ratio(big["wait_p99_s"], least_loaded["wait_p99_s"]),
        "bound_single_big_cache_wait_p99_vs_round_robin": ratio(big["wait_p99_s"], round_robin["wait_p99_s"]),
        "bound_kv_own_prefill_share_of_ttft_p50": ratio(kv["ttft_p50_s"] - kv["wait_p50_s"], kv["ttft_p50_s"]),
    }
