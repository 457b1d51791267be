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
