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
