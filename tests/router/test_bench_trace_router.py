"""tools/bench_trace_router.py on tiny trace subsets: the JSON's shape, hit
rates in [0, 1], kv routing hits at least as much as round-robin, every
request served, and every replica's pool entirely free at the end (no leaked
blocks), also when a small pool forces preemptions."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_trace_router.py"
POLICIES = ["round-robin", "session", "kv", "single-big-cache"]


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
    real = r["router_real"]
    assert 0 < real["decision_without_hashing_p50_us"] <= real["decision_with_hashing_p99_us"]
    assert real["ingest_block_events"] > 0 and real["ingest_block_events_per_s"] > 0


def test_conversation_subset_two_replicas(capsys):
    tool = load_tool()
    out = tool.main(["--trace", "conversation", "--num-requests", "40", "--replicas", "2"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(out))  # stdout is the JSON
    assert out["timing"].startswith("simulated:")
    tr = out["traces"]["conversation"]
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
                     "--load", "1.5"])
    capsys.readouterr()
    tr = out["traces"]["synthetic"]
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
                     "--shared-tier-blocks", "100000"])
    capsys.readouterr()
    pols = out["traces"]["synthetic"]["policies"]
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
                       "--shared-tier-blocks", "64"])
    capsys.readouterr()
    for name, r in small["traces"]["synthetic"]["policies"].items():
        check_policy(r, 1 if name == "single-big-cache" else 2)
        assert r["shared_tier"]["evictions"] > 0


def test_load_sweep(capsys):
    tool = load_tool()
    out = tool.main(["--trace", "synthetic", "--num-requests", "60", "--replicas", "2", "--sweep-loads", "0.5,1.2"])
    capsys.readouterr()
    sweep = out["traces"]["synthetic"]["load_sweep"]
    assert [row["offered_load"] for row in sweep] == [0.5, 1.2]
    for row in sweep:
        for p in ("round-robin", "kv", "single-big-cache"):
            assert 0 < row[p]["ttft_p50_s"] <= row[p]["ttft_p99_s"] and row[p]["utilization"] > 0
        assert row["kv_over_round_robin"]["ttft_p99"] == pytest.approx(
            row["kv"]["ttft_p99_s"] / row["round-robin"]["ttft_p99_s"], abs=1e-3)
    # More offered load, more work per second on the same fleet.
    assert sweep[1]["round-robin"]["utilization"] > sweep[0]["round-robin"]["utilization"]
    with pytest.raises(SystemExit):
        tool.main(["--sweep-loads", "0.5,x"])
