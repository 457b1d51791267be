"""tools/bench_fleet.py on a tiny workload: real engine subprocesses behind
the router, every request served, the JSON's figures and ratios."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_fleet.py"


def test_tiny_run(capsys):
    spec = importlib.util.spec_from_file_location("bench_fleet", TOOL)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tool.main(["--conversations", "3", "--turns", "2", "--input-words", "8:12", "--output-tokens", "4:6",
                     "--system-words", "10", "--blocks-per-replica", "64", "--concurrency", "2",
                     "--policies", "round-robin,kv,one-engine", "--load", "0.5"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(out))
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
