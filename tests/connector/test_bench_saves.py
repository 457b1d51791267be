"""tools/bench_saves.py runs end to end on a tiny size and reports the JSON
shape its readers rely on (figures are not checked: it never asserts)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_saves.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("bench_saves", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def test_bench_saves_reports_every_mode_and_run(tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [f'{{"timestamp": {i * 100}, "input_length": {512 * (1 + i % 3)}, "output_length": 64, '
             f'"hash_ids": [0, {i // 2 + 1}, {100 + i}]}}' for i in range(6)]
    trace.write_text("\n".join(lines) + "\n")
    out = await load_tool().main([
        "--trace", str(trace), "--requests", "6", "--length-divisor", "16", "--load", "0.8",
        "--conversations", "2", "--turns", "2", "--first-turn-tokens", "48", "--user-tokens", "8",
        "--chat-output-tokens", "2", "--trace-pool-tokens", "512", "--chat-pool-tokens", "256",
        "--big-l1-mib", "8", "--disk-mib", "16", "--repeats", "2", "--modes", "none,tinylfu/small",
    ])
    assert out["benchmark"] == "bench_saves" and set(out["workloads"]) == {"trace", "chat"}
    trace_w = out["workloads"]["trace"]
    assert trace_w["requests"] == 6 and trace_w["service_s"] > 0
    for w in out["workloads"].values():
        assert list(w["modes"]) == ["none", "tinylfu/small"]
        for mode, r in w["modes"].items():
            assert len(r["runs"]) == 2
            for run in r["runs"]:
                assert {"ttft_p50_s", "ttft_p99_s", "output_tokens_per_s", "device_hit_rate", "tier_hit_tokens",
                        "tier_hit_rate", "saved_chunks", "admission_rejected"} <= set(run)
            assert {"ttft_p50_s", "ttft_p50_spread_s", "ttft_p50_over_none"} <= set(r["median"])
        assert w["modes"]["none"]["median"]["saved_chunks"] == 0
