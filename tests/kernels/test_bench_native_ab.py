"""tools/bench_native_ab.py, run as developers run it (its own process): it
builds the kernel source at a git revision and the working tree's, and
times and compares both on random packed weights (no GGUF needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.kernels.quant_native import native_kernels

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench_native_ab.py"

needs_git = pytest.mark.skipif(
    subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0,
    reason="not a git checkout")
native = pytest.mark.skipif(native_kernels() is None, reason="no native kernels on this machine")


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


@needs_git
@native
def test_two_builds_compared_row_for_row():
    proc = run_tool("--base", "HEAD", "--qtype", "Q4_K", "--layers", "1", "--tokens", "1,5,13", "--rounds", "1")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["qtype"] == "Q4_K" and r["matmuls_per_pass"] == 4 and r["isa"] in ("avx512_bf16", "avx2")
    assert [row["tokens"] for row in r["results"]] == [1, 5, 13]
    for row in r["results"]:
        assert row["bit_equal"] is True and row["base_ms"] > 0 < row["tree_ms"]


@needs_git
@native
def test_an_unknown_revision_is_named():
    proc = run_tool("--base", "no-such-revision", "--qtype", "Q4_0", "--layers", "1", "--tokens", "1", "--rounds", "1")
    assert proc.returncode != 0
    assert "git show no-such-revision:kvstrata/kernels/csrc/lowbit_bf16.c failed" in proc.stderr
