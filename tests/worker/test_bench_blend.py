"""tools/bench_blend.py runs end to end on SmolLM2 at a tiny size and
reports one row per ratio plus the full prefill, in its JSON shape; ratio 1
agrees with the full prefill exactly."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_blend.py"


def test_the_tool_reports_every_ratio_against_the_full_prefill(smollm2_gguf, capsys):
    spec = importlib.util.spec_from_file_location("bench_blend", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv = ["--requests", "2", "--ratios", "0", "1", "--new-tokens", "3", "--threads", "1",
            "--model", str(smollm2_gguf)]
    report = mod.main(argv)
    out = capsys.readouterr().out  # may start with the loader's log line
    assert json.loads(out[out.index("{\n"):]) == report  # the JSON on stdout is the report
    assert report["command"] == "python tools/bench_blend.py " + " ".join(argv)
    assert report["requests"] == 2 and report["torch_threads"] == 1 and report["deviation"] == "key"
    assert {"python", "torch", "machine"} <= set(report["platform"])
    assert [row["ratio"] for row in report["rows"]] == ["full", 0.0, 1.0]
    full, at_0, at_1 = report["rows"]
    assert full["speedup_vs_full"] == 1.0 and full["ttft_ms_median"] > 0 and 0 <= full["answer_hit"] <= 1
    for row in (at_0, at_1):
        assert set(row) == {"ratio", "first_token_agreement", "mean_kl", "greedy_exact", "greedy_prefix",
                            "recomputed_tokens_median", "answer_hit", "ttft_ms_median", "speedup_vs_full"}
    assert at_1["mean_kl"] < 1e-6 and at_1["greedy_exact"] == 1.0 and at_1["first_token_agreement"] == 1.0
    assert at_1["recomputed_tokens_median"] == report["prompt_tokens_median"]
    assert at_0["recomputed_tokens_median"] < at_1["recomputed_tokens_median"]
    assert 0.5 < report["cached_fraction_mean"] < 1
