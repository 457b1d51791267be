"""tools/bench_fleet.py on a tiny workload, run as users run it (its own
process: it sets up logging as an entry point does): real engine
subprocesses behind the router, every request served; round-robin's
closed-loop capacity first, then every policy open loop at half of it; each
request's wait and slowdown against its own prefill measured on an idle
engine; the balance per window; the goals computed from the figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_fleet.py"
ARGS = ["--conversations", "3", "--turns", "2", "--input-words", "8:12", "--output-tokens", "4:6",
        "--system-words", "10", "--blocks-per-replica", "64", "--concurrency", "2", "--loads", "0.5"]


def test_tiny_run():
    proc = subprocess.run([sys.executable, str(TOOL), *ARGS], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)  # stdout is the JSON alone: logs go to stderr
    assert out["timing"].startswith("real:")
    assert out["command"] == "python tools/bench_fleet.py " + " ".join(ARGS)
    assert out["configuration"]["name"].startswith("custom: fleet-goals-2 but ")
    cal = out["calibration"]["closed_loop_round_robin"]
    assert cal["num_errors"] == 0 and cal["requests_per_replica"] == {"r0": 3, "r1": 3}
    # Every prompt of every run measured alone; at most one per request of the 8 runs (4 policies, 1 load).
    assert 0 < out["own_prefill"]["prompts"] <= 6 * 4 and out["own_prefill"]["p50_s"] > 0
    [row] = out["loads"]
    assert row["offered_load"] == 0.5
    assert row["conversations_per_s"] == round(0.5 * cal["request_throughput"] / 2, 3)
    pols = row["policies"]
    assert list(pols) == ["round-robin", "least-loaded", "kv", "one-engine"]
    for name, r in pols.items():
        assert r["num_errors"] == 0, (name, r)
        assert 0 <= r["prefix_hit_rate"] <= 1 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert sum(r["requests_per_replica"].values()) == 6
        assert r["decision_with_hashing_us"]["p50"] > 0
        assert r["wait_p50_s"] <= r["wait_p99_s"] and 0 < r["slowdown_p50"] <= r["slowdown_p99"]
        if name == "one-engine":
            assert r["replicas"] == 1 and r["balance"] is None
        else:
            bal = r["balance"]
            assert 1.0 <= bal["max_over_mean"] <= 2.0 and bal["windows"] >= 1
            # the worst window's tokens are each replica's prompt less cached tokens: one replica's share
            assert set(bal["worst_window_tokens"]) == {"r0", "r1"}
    g = row["goals"]
    assert g["wait_p99_vs_round_robin"]["kv"] == pols["kv"]["wait_p99_s"]
    assert g["wait_p99_vs_round_robin"]["ref"] == pols["round-robin"]["wait_p99_s"]
    assert g["hit_vs_single_big_cache"]["ref"] == pols["one-engine"]["prefix_hit_rate"]
    assert out["goals_missed"] == [f"load 0.5: {k}" for k, v in g.items() if isinstance(v, dict) and not v["met"]]
