"""tools/bench_trace_router.py on tiny trace subsets: the JSON's shape, hit
rates in [0, 1], kv routing hits at least as much as round-robin, every
request served, and every replica's pool entirely free at the end (no leaked
blocks), also when a small pool forces preemptions; a request alone waits
nothing (its TTFT is its own prefill, on a fleet replica and on the single
big cache, which computes as fast as one replica, not N); the goals per
load; the named configuration is the defaults."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_trace_router.py"
POLICIES = ["round-robin", "least-loaded", "session", "kv", "single-big-cache"]


def load_tool():
    spec = importlib.util.spec_from_file_location("bench_trace_router", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not (mod.DEFAULT_TRACE_DIR / mod.TRACES["conversation"]).exists():
        pytest.skip(f"traces not found in {mod.DEFAULT_TRACE_DIR}")
    return mod


def check_policy(r: dict, replicas: int) -> None:
    assert 0.0 <= r["prefix_hit_rate"] <= 1.0
    assert r["replicas"] == replicas
    assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
    assert r["throughput_tokens_per_s"] > 0 and r["output_tokens_per_s"] > 0
    assert r["replica_load_prefill_tokens"]["max"] >= r["replica_load_prefill_tokens"]["mean"] > 0
    assert r["replica_load_busy_s"]["max"] >= r["replica_load_busy_s"]["mean"] > 0
    assert (r["leaked_blocks"], r["requests_holding_blocks_at_end"]) == (0, 0)
    assert r["wait_p50_s"] <= r["wait_p99_s"] and 0 < r["slowdown_p50"] <= r["slowdown_p99"]
    if r["replicas"] > 1:
        assert 1.0 <= r["balance"]["max_over_mean"] <= replicas and r["balance"]["windows"] >= 1
    real = r["router_real"]
    assert 0 < real["decision_without_hashing_p50_us"] <= real["decision_with_hashing_p99_us"]
    assert real["ingest_block_events"] > 0 and real["ingest_block_events_per_s"] > 0


def test_conversation_subset_two_replicas(capsys):
    tool = load_tool()
    out = tool.main(["--trace", "conversation", "--num-requests", "40", "--replicas", "2", "--loads", "0.8"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(out))  # stdout is the JSON
    assert out["timing"].startswith("simulated:")
    assert out["command"] == "python tools/bench_trace_router.py --trace conversation --num-requests 40 " \
                             "--replicas 2 --loads 0.8"
    assert out["configuration"]["name"] == f"custom: {tool.NAMED} but loads, num-requests, replicas, trace"
    [row] = out["traces"]["conversation"]["loads"]
    tr = row
    assert tr["workload"]["requests"] == 40
    assert list(tr["policies"]) == POLICIES
    for name, r in tr["policies"].items():
        check_policy(r, 1 if name == "single-big-cache" else 2)
        assert sum(r["requests_per_replica"]) == 40
    pols = tr["policies"]
    assert pols["kv"]["prefix_hit_rate"] >= pols["round-robin"]["prefix_hit_rate"]
    assert pols["kv"]["hit_rate_vs_single_big_cache"] > 0
    assert pols["kv"]["router_predicted_hit_rate"] is not None
    assert pols["round-robin"]["requests_per_replica"] == [20, 20]


def test_small_pool_preempts_and_leaks_nothing(capsys):
    tool = load_tool()
    out = tool.main(["--trace", "synthetic", "--num-requests", "60", "--replicas", "2", "--blocks-total", "160",
                     "--loads", "1.5"])
    capsys.readouterr()
    tr = out["traces"]["synthetic"]["loads"][0]
    assert tr["workload"]["clipped_prompts"] > 0  # prompts longer than one replica's pool were cut to fit
    assert sum(tr["policies"][p]["preemptions"] for p in POLICIES) > 0
    for name, r in tr["policies"].items():
        check_policy(r, 1 if name == "single-big-cache" else 2)


def test_shared_tier_counts_for_every_replica(capsys):
    """A shared tier as big as the whole trace: every policy's hits with it
    reach at least its device hits, round-robin reads blocks another replica
    computed, and a tier smaller than the trace evicts (its REMOTE removals
    reach the router in the owners' streams) without leaking a block."""
    tool = load_tool()
    out = tool.main(["--trace", "synthetic", "--num-requests", "100", "--replicas", "2",
                     "--shared-tier-blocks", "100000", "--loads", "0.8"])
    capsys.readouterr()
    pols = out["traces"]["synthetic"]["loads"][0]["policies"]
    for name, r in pols.items():
        check_policy(r, 1 if name == "single-big-cache" else 2)
        assert r["hit_rate_with_shared_tier"] == pytest.approx(r["prefix_hit_rate"] + r["shared_tier_hit_rate"],
                                                               abs=2e-4)
        assert r["shared_tier"]["saved_blocks"] > 0 and r["shared_tier"]["evictions"] == 0
    rr = pols["round-robin"]
    assert rr["shared_tier_hit_rate"] > 0 and rr["shared_tier"]["loaded_tokens"] > 0
    # Every block any replica computed is in the tier: no policy hits less than one big cache's device.
    for name in ("round-robin", "kv"):
        assert pols[name]["hit_rate_with_shared_tier"] >= pols["single-big-cache"]["prefix_hit_rate"]

    small = tool.main(["--trace", "synthetic", "--num-requests", "60", "--replicas", "2",
                       "--shared-tier-blocks", "64", "--loads", "0.8"])
    capsys.readouterr()
    for name, r in small["traces"]["synthetic"]["loads"][0]["policies"].items():
        check_policy(r, 1 if name == "single-big-cache" else 2)
        assert r["shared_tier"]["evictions"] > 0


def test_every_policy_at_every_load_with_its_goals(capsys):
    tool = load_tool()
    out = tool.main(["--trace", "synthetic", "--num-requests", "60", "--replicas", "2", "--loads", "0.5,1.2"])
    capsys.readouterr()
    rows = out["traces"]["synthetic"]["loads"]
    assert [row["offered_load"] for row in rows] == [0.5, 1.2]
    for row in rows:
        pols, g = row["policies"], row["goals"]
        for name, r in pols.items():
            check_policy(r, 1 if name == "single-big-cache" else 2)
        assert g["wait_p99_vs_least_loaded"]["kv"] == pols["kv"]["wait_p99_s"]
        assert g["wait_p99_vs_least_loaded"]["ref"] == pols["least-loaded"]["wait_p99_s"]
        kv_wait, ll_wait = pols["kv"]["wait_p99_s"], pols["least-loaded"]["wait_p99_s"]
        assert g["wait_p99_vs_least_loaded"]["met"] == (kv_wait <= ll_wait / 2)
        assert g["balance_worst_window"]["kv"] == pols["kv"]["balance"]["max_over_mean"]
        missed = [k for k, v in g.items() if isinstance(v, dict) and not v["met"]]
        here = f"synthetic load {row['offered_load']}: "
        assert [m.removeprefix(here) for m in out["goals_missed"] if m.startswith(here)] == missed
    # More offered load, more work per second on the same fleet, and longer waits behind it.
    assert rows[1]["policies"]["round-robin"]["utilization"] > rows[0]["policies"]["round-robin"]["utilization"]
    assert rows[1]["policies"]["round-robin"]["wait_p99_s"] > rows[0]["policies"]["round-robin"]["wait_p99_s"]
    assert len(out["summary"]) == 2 * len(POLICIES)
    with pytest.raises(SystemExit):
        tool.main(["--loads", "0.5,x"])


def test_a_request_alone_waits_nothing_on_a_replica_and_on_the_big_cache(capsys):
    """One request on an idle fleet: its TTFT is its own prefill by the cost
    model (wait 0, slowdown 1) under every policy, the single big cache
    included: its lanes compute as fast as one replica (it had N times the
    speed before, which made its TTFT its prefill / N)."""
    tool = load_tool()
    out = tool.main(["--trace", "synthetic", "--num-requests", "1", "--replicas", "4", "--loads", "1.0"])
    capsys.readouterr()
    row = out["traces"]["synthetic"]["loads"][0]
    for name, r in row["policies"].items():
        assert r["wait_p50_s"] == r["wait_p99_s"] == 0.0, name
        assert r["slowdown_p50"] == 1.0, name
    args = tool.parse_args([])
    prompt = round(row["workload"]["prompt_tokens_mean"])
    assert row["policies"]["single-big-cache"]["ttft_p50_s"] == round(tool.own_prefill_s(prompt, args), 4)


def test_the_named_configuration_is_the_defaults():
    tool = load_tool()
    args = tool.parse_args([])
    assert tool.configuration(args)["name"] == tool.NAMED
    assert args.loads == [0.8, 1.0] and args.trace == "both" and args.balance_window_s == 30.0
    assert tool.configuration(tool.parse_args(["--replicas", "8"]))["name"] == f"custom: {tool.NAMED} but replicas"
