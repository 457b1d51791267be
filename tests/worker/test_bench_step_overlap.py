"""tools/bench_step_overlap.py runs (its --quick shape) and its simulated
device is what the steps wait on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_reports_every_mode_and_the_device_bounds_each_step():
    env = {**os.environ, "KVSTRATA_LOG_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_step_overlap.py"), "--quick"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["host"]["event_loop"] in ("uvloop", "asyncio")  # the engine's own loop (uvloop where installed)
    rows = report["rows"]
    assert [(r["batch"], r["device_ms"]) for r in rows] == [(2, 0.0), (2, 3.0), (8, 0.0), (8, 3.0)]
    for r in rows:
        for mode in ("serial", "async", "pipelined"):
            step = r[mode]["ms_per_step"]
            assert step > 0
            if r["device_ms"]:  # every step waits for its simulated device time: a lower bound
                assert step >= r["device_ms"] * 0.98 and r[mode]["over_device"] == round(step / 3.0, 3)
        assert r["transport"] == "inproc" and r[mode]["engine_cpu_ms_per_step"] > 0


def test_the_ipc_transport_runs_the_engine_in_its_own_process_under_the_simulated_device():
    """--transports ipc: the engine process is this script wrapping
    ``kvstrata.ipc.engine_proc`` (``spawn_engine(wrapper=...)``), so the
    simulated device bounds its steps too, and its CPU time is its own."""
    env = {**os.environ, "KVSTRATA_LOG_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_step_overlap.py"), "--batches", "4",
                           "--steps", "16", "--modes", "pipelined", "--transports", "ipc"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)["rows"]
    assert [(r["transport"], r["device_ms"]) for r in rows] == [("ipc", 0.0), ("ipc", 3.0)]
    timed = rows[1]["pipelined"]
    assert timed["ms_per_step"] >= 3.0 * 0.98  # the device the engine process waited on
    assert timed["engine_cpu_ms_per_step"] > 0 and timed["client_cpu_ms_per_step"] > 0
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_step_overlap.py"), "--transports", "tcp"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert bad.returncode == 2 and "unknown transport(s) tcp" in bad.stderr
