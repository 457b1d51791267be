"""tools/loadtest.py through each target, with the null executor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "loadtest.py"


def _loadtest(*args: str) -> dict:
    proc = subprocess.run([sys.executable, str(TOOL), "--executor", "null", "--log-level", "WARNING",
                           "--no-progress", *args], capture_output=True, text=True, timeout=180,
                          env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("target", ["inproc", "zmq", "http"])
def test_multi_turn_report_through_every_target(target):
    r = _loadtest("--target", target, "--workload", "multi-turn", "--num-requests", "4", "--turns", "3",
                  "--output-len", "4:4", "--concurrency", "2")
    assert (r["target"], r["num_requests"], r["num_completed"], r["num_errors"]) == (target, 12, 12, 0)
    assert r["output_tokens"] == 48
    assert r["prefix_cache"]["device"]["hit_tokens"] > 0  # growing context behind a shared system prompt
    assert r["ttft_ms"]["p50"] is not None and r["preemptions"] == 0


def test_trace_with_arrival_times_and_poisson_rate(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 0.01, "input_len": 5, "output_len": 2}) + "\n"
                             for i in range(5)))
    r = _loadtest("--target", "zmq", "--workload", "trace", "--trace", str(trace), "--output",
                  str(tmp_path / "out.json"), "--plot-dir", str(tmp_path / "plots"))
    assert (r["num_completed"], r["output_tokens"]) == (5, 10)
    assert json.loads((tmp_path / "out.json").read_text())["num_completed"] == 5
    assert r["duration_s"] >= 0.04  # the last arrival is at 40 ms
    r = _loadtest("--target", "inproc", "--workload", "random", "--num-requests", "6", "--rate", "50",
                  "--output-len", "2:2")
    assert (r["num_completed"], r["rate"]) == (6, 50.0)
