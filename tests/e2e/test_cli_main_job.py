"""`kvstrata run`, the README's first command: the engine subprocess with the
default model (SmolLM2-135M-Instruct's GGUF, fetched into the cache once), a
small multi-turn workload, the printed report."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _kvstrata(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstrata", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "KVSTRATA_LOG_LEVEL": "WARNING"})


_SMALL_JOB = ("--workload", "multi-turn", "--num-requests", "2", "--turns", "2", "--output-len", "3:3", "--input-len", "2:4",
              "--prefix-len", "8", "--no-progress")


def test_main_job_runs_to_completion_with_a_small_workload(tmp_path):
    out = tmp_path / "report.json"
    proc = _kvstrata("run", *_SMALL_JOB, "--kv-store-dir", str(tmp_path / "kv"), "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["num_requests"], report["num_completed"], report["num_errors"]) == (4, 4, 0)
    assert report["output_tokens"] == 12  # 4 turns x 3 tokens (ignore_eos)
    assert report["executor"] == "model" and report["target"] == "zmq"
    assert report["workload"] in ("multi-turn", "sharegpt")
    # turn 2 of each chat extends turn 1's prompt: its full blocks are device hits
    assert report["prefix_cache"]["device"]["hit_tokens"] > 0
    assert report["preemptions"] == 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(report[key]) == {"mean", "p50", "p90", "p99"}
    assert "requests        4/4 ok" in proc.stdout
    assert "hit rate device" in proc.stdout
    assert "synthetic multi-turn" in proc.stdout or "ShareGPT" in proc.stdout
    assert "CPU tier" in proc.stdout and "disk tier" in proc.stdout


def test_a_second_main_job_hits_what_the_first_stored_on_disk(tmp_path):
    """The disk tier survives the engine process: a fresh engine (cold device
    cache, empty CPU tier) finds the first run's chunks on disk."""
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    store = str(tmp_path / "kv")
    for out in (first, second):
        proc = _kvstrata("run", *_SMALL_JOB, "--prefix-len", "80", "--kv-store-dir", store, "--output", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
    cold = json.loads(first.read_text())["prefix_cache"]
    warm = json.loads(second.read_text())["prefix_cache"]
    assert cold.get("disk", {}).get("hit_tokens", 0) == 0
    assert warm["disk"]["hit_tokens"] > 0
    assert json.loads(second.read_text())["output_tokens"] == 12


def test_config_errors_name_the_field_and_exit_2():
    proc = _kvstrata("run", "--scheduler.max-num-seqs", "0")
    assert proc.returncode == 2
    assert "scheduler.max_num_seqs" in proc.stderr
