"""tools/bench_fleet.py on a tiny workload, run as users run it (its own
process: it sets up logging as an entry point does): real engine
subprocesses behind the router, every request served, the JSON's figures
and ratios, the open-loop run at half of round-robin's capacity."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_fleet.py"


def test_tiny_run():
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--conversations", "3", "--turns", "2", "--input-words", "8:12",
         "--output-tokens", "4:6", "--system-words", "10", "--blocks-per-replica", "64", "--concurrency", "2",
         "--policies", "round-robin,kv,one-engine", "--load", "0.5"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)  # stdout is the JSON alone: logs go to stderr
    assert out["timing"].startswith("real:")
    for name, r in out["policies"].items():
        assert r["num_errors"] == 0, (name, r)
        assert 0 <= r["prefix_hit_rate"] <= 1 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert sum(r["requests_per_replica"].values()) == 6
        assert r["decision_with_hashing_us"]["p50"] > 0
    assert out["policies"]["round-robin"]["requests_per_replica"] == {"r0": 3, "r1": 3}
    assert set(out["kv_over_round_robin"]) == {"ttft_p50", "ttft_p99", "request_throughput"}
    assert out["policies"]["one-engine"]["replicas"] == 1
    ol = out["open_loop"]  # Poisson arrivals at half of round-robin's closed-loop capacity
    assert ol["conversations_per_s"] == round(0.5 * out["policies"]["round-robin"]["request_throughput"] / 2, 3)
    assert set(ol["policies"]) == {"round-robin", "kv", "one-engine"}
    assert all(r["num_errors"] == 0 for r in ol["policies"].values()) and "kv_over_round_robin" in ol
