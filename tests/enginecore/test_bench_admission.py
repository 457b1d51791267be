"""tools/bench_admission.py on a small burst: cache-aware admission finds
more prefix hits than FCFS, and no request waits more than the aging bound
past its FCFS turn."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_admission.py"


def test_cache_aware_beats_fcfs_on_hits_within_the_bound():
    spec = importlib.util.spec_from_file_location("bench_admission", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    report = mod.main(["--requests", "120", "--families", "8", "--max-skips", "10", "--prefix-len", "128",
                       "--num-blocks", "48"])
    fcfs, aware = report["runs"]
    assert fcfs["worst_wait_past_fcfs_admissions"] == 0
    assert aware["prefix_hit_rate"] > fcfs["prefix_hit_rate"]
    assert aware["worst_wait_past_fcfs_admissions"] <= 10 and aware["max_skips_observed"] <= 10
