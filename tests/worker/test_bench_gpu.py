"""tools/bench_gpu.py, run as users run it (its own process), on the CPU: the
tiny shape and counts, every section in the JSON with no error and the
figures it should have, each section also flushed to stderr as it ended;
and the profile section's trace summary on a synthetic CUDA trace (the
part of the GPU path a CPU run cannot reach)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_gpu.py"


def _tool():
    if "bench_gpu" not in sys.modules:  # registered first: its dataclasses look their module up
        spec = importlib.util.spec_from_file_location("bench_gpu", TOOL)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_gpu"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["bench_gpu"]


def _errors(node, where="report"):
    """(where, error) for every "error" in the report that is not None."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "error" and v is not None:
                yield where, v
            else:
                yield from _errors(v, f"{where}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _errors(v, f"{where}[{i}]")


def test_quick_cpu_run_reports_every_section():
    proc = subprocess.run([sys.executable, str(TOOL), "--quick", "--device", "cpu"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)  # stdout is the JSON alone: logs and partial lines go to stderr
    sections = _tool().SECTIONS
    assert list(r)[:len(sections)] == list(sections)
    assert list(_errors(r)) == []
    flushed = [json.loads(line[len("bench_gpu "):]) for line in proc.stderr.splitlines()
               if line.startswith("bench_gpu {")]
    assert [next(iter(x)) for x in flushed] == [s for s in _tool().ORDER]

    cfg = r["config"]
    assert cfg["note"] == "tiny CPU shape; GPU figures need CUDA" and cfg["dtype"] == "float32"
    assert cfg["model_shape"]["hidden_size"] == 64 and cfg["command"].endswith("--quick --device cpu")
    bw = r["copy_bandwidth"]
    assert bw["copy_gb_s"] > 0 and bw["read_gb_s"] > 0 and bw["weight_read_limit_tok_s"] > 0
    assert {"config.json", "model.safetensors"} <= set(r["model"]["files"])

    long = r["first_long_prompt_s"]
    assert long["first_ttft_s"] > 0 and len(long["next_ttft_s"]) == 2 and long["next_ttft_p50_s"] > 0
    assert long["engines_started_before_in_process"] == 0
    for mode in ("graphs_off", "graphs_on", "pipelined"):
        d = r["decode_single_stream"][mode]
        assert d["decode_tok_s"] > 0 and d["tokens"] == 8
        for name, n in (("batch_64x512_128", 4), ("batch_256x512_128", 8)):
            b = r[name][mode]
            assert r[name]["workload"]["requests"] == n
            assert b["output_tokens"] == n * 8 and b["output_tok_s"] > 0 and b["wall_s"] > 0
            assert b["preemptions"] == 0
        p = r["profile_decode_step"][mode]
        assert p["steps"] == 4 and p["decode_only_steps"] == 4 and p["cpu_ops_per_step"] > 0

    served = r["batch_64_served"]  # the engine in its own process: the same greedy tokens
    assert served["workload"]["requests"] == 4 and served["output_tok_s"] > 0 and served["steady_decode_tok_s"] > 0
    assert served["tokens_equal_in_process"] is True and "gpu_busy_fraction_unprofiled_est" not in served  # no GPU

    hf = r["transformers_generate"]
    assert hf["output_tokens"] == 4 * 8 and hf["output_tok_s"] > 0
    assert all(x > 0 for x in hf["ours_over_theirs"].values())
    sp = r["shared_prefix_ttft"]
    assert sp["caching_on"]["ttft_p50_s"] > 0 and sp["caching_off"]["ttft_p50_s"] > 0
    assert sp["caching_on"]["cached_tokens_p50"] == 64 and sp["caching_off"]["cached_tokens_p50"] == 0
    t = r["tiers"]
    assert t["ttft_p50_later_turns_s"]["recompute"] > 0 and t["ttft_p50_later_turns_s"]["tiers"] > 0
    assert t["ttft_p50_later_turns_s"]["tiers_staged"] > 0 and t["tier_hit_tokens_staged"]["cpu"] > 0
    assert t["ttft_p50_later_turns_s"]["recompute_saving"] > 0 and t["later_turns_recompute_saving_over_tiers"] > 0
    assert t["tier_hit_tokens"]["cpu"] > 0 and t["workload"]["working_set_over_pool"] > 2
    counters = t["bench_tiers"]["modes"]["tiers"]["connector"]  # where a tier hit's time goes
    assert counters["connector.cpu.hit_tokens"] == t["tier_hit_tokens"]["cpu"] and counters["connector.cpu.load_s"] > 0
    assert counters["connector.sync_loads"] + counters["connector.async_loads"] > 0


def test_trace_summary_counts_per_step():
    def x(cat, name, ts, dur=1.0, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    events = [
        x("user_annotation", "bench_decode_step", 0, 100), x("user_annotation", "bench_decode_step", 120, 100),
        x("kernel", "gemm", 10, 20, **{"graph id": 0}), x("kernel", "norm", 20, 30, **{"graph id": 0}),
        x("kernel", "attn", 130, 20, **{"graph id": 7}),
        x("cuda_runtime", "cudaLaunchKernel", 5), x("cuda_runtime", "cudaLaunchKernel", 15),
        x("cuda_driver", "cuLaunchKernelEx", 125), x("cuda_runtime", "cudaGraphLaunch", 126),
        x("cuda_runtime", "cudaStreamSynchronize", 90), x("cuda_runtime", "cudaStreamSynchronize", 200),
        x("cuda_runtime", "cudaDeviceSynchronize", 230),  # the probe's closing sync: after the last step
        x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 2), x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 121),
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 95),
        x("cpu_op", "aten::mm", 6), x("cpu_op", "aten::add", 16), x("cpu_op", "aten::mm", 300),
        {"ph": "M", "name": "process_name", "args": {}},
    ]
    s = _tool().summarize_trace(events, cuda=True)
    assert s["steps"] == 2 and s["step_ms_profiled"] == 0.11 and s["cpu_ops_per_step"] == 1.0
    assert s["kernels_per_step"] == 1.5 and s["kernels_in_graphs_per_step"] == 0.5
    assert s["host_kernel_launches_per_step"] == 1.5 and s["graph_launches_per_step"] == 0.5
    assert s["gpu_busy_fraction"] == round(60 / 220, 3)  # [10, 50] and [130, 150] over [0, 220]
    assert s["memcpy_htod_per_step"] == 1.0 and s["memcpy_htod_pageable"] == 1
    assert s["memcpy_dtoh_per_step"] == 0.5 and s["memcpy_dtoh_pageable"] == 1
    assert s["host_syncs_per_step"] == 1.0 and s["host_sync_calls"] == {"cudaStreamSynchronize": 2}
    assert "few kernels" in s["note"]  # one graph launch and three kernels: CUPTI may have missed the graph's


def test_unprofiled_busy_fraction_is_profiled_gpu_time_over_the_steady_step():
    """64 requests at 32,000 steady tok/s are 2 ms steps; 40 % of a 4 ms
    profiled step is 1.6 ms of kernels: 80 % busy without the profiler. Only
    for the same request count, and never above 1."""
    unprofiled_busy = _tool().unprofiled_busy

    batch = {"workload": {"requests": 64}, "pipelined": {"steady_decode_tok_s": 32000.0},
             "graphs_on": {"steady_decode_tok_s": 8000.0}, "graphs_off": {"steady_decode_tok_s": None}}
    prof = {"pipelined": {"gpu_busy_fraction": 0.4, "step_ms_profiled": 4.0},
            "graphs_on": {"gpu_busy_fraction": 0.9, "step_ms_profiled": 10.0},
            "graphs_off": {"gpu_busy_fraction": None, "step_ms_profiled": 30.0}}
    unprofiled_busy(prof, batch, 64)
    assert prof["pipelined"]["gpu_busy_fraction_unprofiled_est"] == 0.8 and prof["pipelined"]["gpu_ms_per_step"] == 1.6
    assert prof["graphs_on"]["gpu_busy_fraction_unprofiled_est"] == 1.0
    assert "gpu_busy_fraction_unprofiled_est" not in prof["graphs_off"]
    other = {"pipelined": {"gpu_busy_fraction": 0.4, "step_ms_profiled": 4.0}}
    unprofiled_busy(other, {**batch, "workload": {"requests": 256}}, 64)
    assert "gpu_busy_fraction_unprofiled_est" not in other["pipelined"]
