"""tools/bench_decode_modes.py runs end to end on the seeded random model:
every case pairs off/on runs that produce the same greedy tokens, and the
speculative cases report their acceptance."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_decode_modes.py"


def test_the_tool_reports_each_case_with_equal_tokens(capsys):
    spec = importlib.util.spec_from_file_location("bench_decode_modes", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    report = mod.main(["--model", "random", "--rounds", "1", "--threads", "1", "--concurrency", "4",
                       "--decode-tokens", "6", "--spec-concurrency", "2", "--spec-tokens", "12"])
    assert [c["case"] for c in report["cases"]] == ["async_scheduling", "spec_repetitive", "spec_non_repetitive"]
    for c in report["cases"]:
        assert c["same_tokens"] and c["off_tokens_per_s"] > 0 and c["on_tokens_per_s"] > 0
    rep = report["cases"][1]
    assert rep["spec.num_draft_tokens"] > 0 and 0.0 <= rep["spec.acceptance_rate"] <= 1.0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("}") and "\"spec_non_repetitive\"" in out  # the JSON report on stdout
