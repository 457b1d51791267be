"""tools/profile_summary.py on py-spy's collapsed stacks: busy samples per
thread, inclusive and self counts, idle and import samples left out."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "profile_summary.py"

RAW = """\
thread (1): MainThread;run (/x/kvstrata/enginecore/async_engine.py:559);schedule (/x/kvstrata/s.py:10) 30
thread (1): MainThread;run (/x/kvstrata/enginecore/async_engine.py:559);update (/x/kvstrata/u.py:5);detok (/x/kvstrata/d.py:2) 10
thread (1): MainThread;Runner.run (asyncio/runners.py:118) 500
thread (1): MainThread;<module> (a.py:1);_find_and_load (<frozen importlib._bootstrap>:1360) 40
thread (2): kvstrata-step_0;_worker (concurrent/futures/thread.py:83);launch (/x/kvstrata/m.py:1) 20
thread (2): kvstrata-step_0;_worker (concurrent/futures/thread.py:81) 900
thread (3): tqdm_monitor;run (threading.py:1);Condition.wait (threading.py:320) 77
garbage line
"""


def test_busy_samples_inclusive_and_self_per_thread(tmp_path):
    path = tmp_path / "host_profile.txt"
    path.write_text(RAW)
    proc = subprocess.run([sys.executable, str(TOOL), str(path), "--top", "5"], capture_output=True, text=True,
                          check=True)
    r = json.loads(proc.stdout)
    assert list(r) == ["thread (1): MainThread", "thread (2): kvstrata-step_0"]  # the waiting thread: no busy sample
    main, step = r["thread (1): MainThread"], r["thread (2): kvstrata-step_0"]
    assert main["busy_samples"] == 40 and step["busy_samples"] == 20  # idle and import samples left out
    inclusive = {f: n for f, n, _ in main["inclusive"]}
    assert inclusive["run (kvstrata/enginecore/async_engine.py)"] == 40
    assert inclusive["schedule (kvstrata/s.py)"] == 30 and inclusive["detok (kvstrata/d.py)"] == 10
    assert main["self"][0] == ["schedule (kvstrata/s.py)", 30, 0.75]
    assert step["self"] == [["launch (kvstrata/m.py)", 20, 1.0]]


def test_match_keeps_only_those_frames_inclusive():
    spec = importlib.util.spec_from_file_location("profile_summary", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.summarize(RAW.splitlines(), match="kvstrata/u.py", by_line=True)
    assert r["thread (1): MainThread"]["inclusive"] == [["update (kvstrata/u.py:5)", 10, 0.25]]
