"""tools/bench_quant.py --engine-gpu, run as users run it (its own process),
on this CPU: the dry run writes a tiny random Q4_0 GGUF and times both
modes through real engines, so the GPU run has no untried code path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf")

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_quant.py"


def test_engine_gpu_dry_run_on_a_cpu():
    proc = subprocess.run([sys.executable, str(TOOL), "--engine-gpu", "--engine-repeats", "1", "--threads", "1"],
                          capture_output=True, text=True, timeout=300, check=True)
    r = json.loads(proc.stdout)["engine_gpu"]
    assert r["device"].startswith("cpu (dry run") and r["qtype"] == "Q4_0"
    for mode in ("dequantize", "packed"):
        m = r["modes"][mode]
        assert len(m["single_runs"]) == len(m["batch16_runs"]) == 1 and m["single_tok_s"] > 0 < m["batch16_tok_s"]
    assert r["packed_over_dequantize"]["weight_bytes"] < 0.5
    assert r["file_tensor_bytes"] > 0
