"""The placement measures the benchmarks report (kvstrata.router.load):
the worst window's max / mean dispatched prefill per replica (every window
examined, against a brute force over a fine grid of window ends), TTFT wait
and slowdown against own prefill, and the routing goals' arithmetic."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.router.load import routing_goals, wait_summary, worst_window_balance

R = ["a", "b"]


def test_a_window_that_loses_a_dispatch_counts_as_well():
    # (0, 30] holds b's 10 alone: a's dispatch at 0 has left it, nothing has come yet.
    out = worst_window_balance([(0, "a", 10), (1, "b", 10), (40, "a", 30), (41, "b", 10)], R, 30)
    assert out["max_over_mean"] == 2.0 and out["worst_window_end_s"] == 30
    assert out["worst_window_tokens"] == {"a": 0.0, "b": 10.0}
    assert out["worst_window_largest_dispatch_over_mean"] == 2.0


def test_a_run_shorter_than_a_window_is_one_window():
    out = worst_window_balance([(0, "a", 30), (1, "b", 10), (2, "a", 0)], R, 30)
    assert (out["max_over_mean"], out["windows"], out["worst_window_tokens"]) == (1.5, 1, {"a": 30.0, "b": 10.0})
    assert out["worst_window_largest_dispatch_over_mean"] == 1.5


def test_no_work_no_ratio_and_bad_windows_are_named():
    assert worst_window_balance([], R, 30) == {"max_over_mean": None, "windows": 0}
    assert worst_window_balance([(0, "a", 0), (1, "b", 0)], R, 30)["max_over_mean"] is None
    with pytest.raises(ValueError, match="window_s must be > 0"):
        worst_window_balance([(0, "a", 1)], R, 0)


def brute_force(ds, replicas, w):
    """Max / mean over windows (s - w, s] for s on a grid of half steps inside the run."""
    first, last = min(t for t, _, _ in ds), max(t for t, _, _ in ds)
    if last - first < w:
        ends = [last]
    else:
        ends = [first + w + k / 2 for k in range(int(2 * (last - first - w)) + 1)]
    worst = None
    for s in ends:
        sums = {r: sum(x for t, rr, x in ds if rr == r and s - w < t <= s) for r in replicas}
        mean = sum(sums.values()) / len(replicas)
        if mean > 0:
            worst = max(worst or 0.0, max(sums.values()) / mean)
    return worst


@settings(max_examples=200, deadline=None)
@given(ds=st.lists(st.tuples(st.integers(0, 60), st.sampled_from(["a", "b", "c"]), st.integers(0, 50)),
                   min_size=1, max_size=30),
       w=st.integers(1, 40))
def test_worst_window_equals_a_brute_force_over_every_window(ds, w):
    replicas = ["a", "b", "c"]
    out = worst_window_balance(ds, replicas, w)
    want = brute_force(ds, replicas, w)
    if want is None:
        assert out["max_over_mean"] is None
    else:
        assert out["max_over_mean"] == pytest.approx(round(want, 3), abs=1e-3)
        assert 1.0 <= out["max_over_mean"] <= len(replicas)


def test_wait_and_slowdown_are_against_each_requests_own_prefill():
    ttft = [0.5, 1.0, 4.0, 0.2]
    own = [0.5, 0.5, 1.0, 0.4]
    out = wait_summary(ttft, own)
    # waits sorted: -0.2, 0, 0.5, 3.0; slowdowns sorted: 0.5, 1, 2, 4 (p50: index 2, p99: index 3)
    assert out == {"wait_p50_s": 0.5, "wait_p99_s": 3.0, "slowdown_p50": 2.0, "slowdown_p99": 4.0}
    with pytest.raises(ValueError, match="4 TTFTs but 3"):
        wait_summary(ttft, own[:3])
    with pytest.raises(ValueError, match="> 0"):
        wait_summary([1.0], [0.0])


def fig(wait_p99, ttft_p50, hit, wait_p50=0.0, balance=None):
    return {"wait_p99_s": wait_p99, "wait_p50_s": wait_p50, "ttft_p50_s": ttft_p50, "prefix_hit_rate": hit,
            "balance": {"max_over_mean": balance} if balance is not None else None}


def test_routing_goals_compare_kv_with_each_baseline():
    kv = fig(1.0, 0.3, 0.57, wait_p50=0.1, balance=1.2)
    g = routing_goals(kv, fig(3.0, 0.9, 0.5), fig(2.5, 0.5, 0.5), fig(0.8, 0.3, 0.6))
    assert g["wait_p99_vs_round_robin"] == {"kv": 1.0, "ref": 3.0, "ratio": 0.333, "goal": "<= 0.333", "met": True}
    assert g["wait_p99_vs_least_loaded"]["met"] and g["wait_p99_vs_least_loaded"]["ratio"] == 0.4
    assert g["wait_p99_vs_single_big_cache"]["met"] and g["wait_p99_vs_single_big_cache"]["ratio"] == 1.25
    assert g["ttft_p50_vs_round_robin"]["met"]
    assert g["hit_vs_single_big_cache"] == {"kv": 0.57, "ref": 0.6, "ratio": 0.95, "goal": ">= 0.95", "met": True}
    assert g["balance_worst_window"] == {"kv": 1.2, "goal": "<= 1.25", "met": True}
    assert g["bound_single_big_cache_ttft_p50_vs_round_robin"] == 0.333
    assert g["bound_kv_own_prefill_share_of_ttft_p50"] == round(0.2 / 0.3, 3)
    worse = routing_goals(fig(1.01, 0.31, 0.56, balance=1.3), fig(3.0, 0.9, 0.5), fig(2.0, 0.5, 0.5),
                          fig(0.8, 0.3, 0.6))
    assert [k for k, v in worse.items() if isinstance(v, dict) and not v["met"]] == [
        "wait_p99_vs_round_robin", "wait_p99_vs_least_loaded", "wait_p99_vs_single_big_cache",
        "ttft_p50_vs_round_robin", "hit_vs_single_big_cache", "balance_worst_window"]
    # A negative or zero reference (kv waits less than nothing) gives no ratio, and a goal met only by being <=.
    zero = routing_goals(fig(0.0, 0.3, 0.5), fig(-0.1, 0.9, 0.5), fig(0.0, 0.5, 0.5), fig(0.0, 0.3, 0.5))
    assert zero["wait_p99_vs_round_robin"]["ratio"] is None and not zero["wait_p99_vs_round_robin"]["met"]
    assert zero["wait_p99_vs_least_loaded"]["met"]
