"""tools/bench_router.py on a small setup: the JSON's figures, and the
router scores every request at the same least cost as the block-by-block
baseline walking per-(replica, medium) sets."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_router.py"


def test_small_run_agrees_with_the_baseline(capsys):
    spec = importlib.util.spec_from_file_location("bench_router", TOOL)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tool.main(["--prompts", "40", "--requests", "40", "--prompt-tokens", "512", "--replicas", "4",
                     "--hash-algo", "xxhash", "--turn-tokens", "32"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(out))
    assert out["same_cost_as_baseline"] == 1.0
    assert out["ingest"]["block_events"] > 0 and out["ingest"]["block_events_per_s"] > 0
    for k in ("decision_with_hashing", "decision_without_hashing", "baseline_decision_without_hashing"):
        assert 0 < out[k]["p50_us"] <= out[k]["p99_us"]
    assert out["decision_without_hashing"]["p50_us"] <= out["decision_with_hashing"]["p50_us"]
    mt, cold = out["hashing"]["multi_turn"], out["hashing"]["cold"]
    assert mt["reused_block_fraction"] > 0 and cold["reused_block_fraction"] == 0  # follow-ups reuse their prefix
    for kind in (mt, cold):
        assert 0 < kind["hashing_before_decision"]["p50_us"] <= kind["decision_with_lazy_hashing"]["p99_us"]
