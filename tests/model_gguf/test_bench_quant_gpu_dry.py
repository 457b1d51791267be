"""tools/bench_quant.py --engine-gpu and --gpu-kernels, run as users run
them (their own process), on this CPU: the engine dry run writes a tiny
random Q4_0 GGUF and times both modes through real engines, the kernel dry
run times the decode GEMVs (one token: both kernels), the general kernel and
torch.mm in the Triton interpreter, so the GPU run has no untried code path."""

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
        assert len(m["single_runs"]) == len(m["batch16_runs"]) == len(m["ttft_runs_s"]) == 1
        assert m["single_tok_s"] > 0 < m["batch16_tok_s"] and m["ttft_s"] > 0
    assert r["packed_over_dequantize"]["weight_bytes"] < 0.5 and r["packed_over_dequantize"]["ttft_speed"] > 0
    assert r["file_tensor_bytes"] > 0
    assert _progress(proc.stderr, "engine_gpu") == [{"dequantize": r["modes"]["dequantize"]["single_runs"]},
                                                    {"packed": r["modes"]["packed"]["single_runs"]}]


def test_engine_gpu_file_written_once_then_taken(tmp_path):
    """--write-only writes --gpu-file (the GPU check writes the 4.5 GB file
    while its tests run); a later run takes the file as it is."""
    path = tmp_path / "q.gguf"
    proc = subprocess.run([sys.executable, str(TOOL), "--engine-gpu", "--write-only", "--gpu-file", str(path)],
                          capture_output=True, text=True, timeout=300, check=True)
    written = json.loads(proc.stdout)["engine_gpu"]
    assert "modes" not in written and written["file_tensor_bytes"] > 0
    assert path.exists() and not (tmp_path / "q.gguf.part").exists()
    stamp = path.stat().st_mtime_ns
    proc = subprocess.run([sys.executable, str(TOOL), "--engine-gpu", "--engine-repeats", "1", "--threads", "1",
                           "--gpu-file", str(path)], capture_output=True, text=True, timeout=300, check=True)
    r = json.loads(proc.stdout)["engine_gpu"]
    assert path.stat().st_mtime_ns == stamp and r["file_tensor_bytes"] == written["file_tensor_bytes"]
    assert r["modes"]["packed"]["single_tok_s"] > 0


def test_gpu_kernels_dry_run_on_a_cpu():
    proc = subprocess.run([sys.executable, str(TOOL), "--gpu-kernels"], capture_output=True, text=True, timeout=300,
                          check=True)
    r = json.loads(proc.stdout)
    assert r["note"].startswith("no CUDA device: a dry run")
    assert list(r["sets"]["tiny"]) == ["Q4_K"]
    gpu = r["sets"]["tiny"]["Q4_K"]["gpu"]
    assert sorted(gpu) == ["tokens_1", "tokens_16", "tokens_4", "tokens_512", "tokens_8"]
    assert "general_bn16_ms" in gpu["tokens_16"] and "general_bn16_ms" not in gpu["tokens_8"]
    assert "general_bn16_ms" not in gpu["tokens_512"]
    assert gpu["tokens_1"]["gemv_many_ms"] > 0 and gpu["tokens_1"]["packed_speedup_vs_gemv_many"] > 0
    assert all("gemv_many_ms" not in gpu[k] for k in gpu if k != "tokens_1")
    for row in gpu.values():
        assert row["packed_ms"] > 0 and row["general_ms"] > 0 and row["dense_bf16_ms"] > 0
        assert row["max_err_over_S"] <= 2.0**-7  # bf16 output
    assert _progress(proc.stderr, "gpu_kernels") == [{"Q4_K": r["sets"]["tiny"]["Q4_K"]}]


def _progress(stderr: str, part: str) -> list[dict]:
    """The tool's per-part lines on stderr (what a run cut short keeps), as
    {key: value} per line; for engine_gpu, each mode's single-stream runs."""
    lines = [json.loads(line.split(" ", 1)[1])[part] for line in stderr.splitlines()
             if line.startswith("bench_quant {")]
    if part == "engine_gpu":
        return [{mode: v["single_runs"] for mode, v in line.items() if mode != "write_s"} for line in lines]
    return lines


SWEEP = TOOL.with_name("sweep_quant_tiles.py")


def test_tile_sweep_dry_run_on_a_cpu():
    """tools/sweep_quant_tiles.py in the interpreter: every config runs and is
    checked (GEMV error bound, dequantize bit-exact), the best are ranked."""
    proc = subprocess.run([sys.executable, str(SWEEP), "--types", "Q4_0", "--tokens", "1", "--reps", "1"],
                          capture_output=True, text=True, timeout=300, check=True)
    r = json.loads(proc.stdout)
    assert r["device"].startswith("cpu (dry run")
    gemv, deq = r["gemv_Q4_0_tokens_1"], r["dequantize_Q4_0"]
    assert gemv["failed"] == 0 and gemv["speedup_best_vs_default"] > 0
    # the layers' config lists differ in length (gate's K dedupes two of its tiles): each layer is its own
    assert [len(layer["all"]) for layer in gemv["layers"].values()] == [3, 4]
    for layer in gemv["layers"].values():
        assert all(row["err_over_S"] <= 2.0**-7 and row["ms"] > 0 for row in layer["all"])  # bf16 output
        assert [b["ms"] for b in layer["best"]] == sorted(b["ms"] for b in layer["best"]) and layer["default_ms"] > 0
    assert gemv["best_ms"] == round(sum(layer["best"][0]["ms"] for layer in gemv["layers"].values()), 4)
    assert deq["failed"] == 0
    assert all(row["bit_exact"] for layer in deq["layers"].values() for row in layer["all"])
    assert [line.split(" ", 1)[0] for line in proc.stderr.splitlines() if line.startswith("sweep ")] == ["sweep"] * 2
