"""Paged attention against torch SDPA on the same K/V laid out densely; prints one JSON object.

GPU (when CUDA is present), bf16, block size 16, shuffled blocks:
  decode   one new token per sequence, batch 1, 8, 32, 64, 256 x context
           2048, 4096, for TinyLlama's heads (Hq 32, Hkv 4, D 64) and for
           Hq 32, Hkv 8, D 128. Ours with split-K chosen automatically (and,
           for reference, forced to no split) vs SDPA on [B, Hkv, ctx, D]
           with enable_gqa (the same bytes). Goal: ratio <= 1.1.
  prefill  4 prompts of 2048 tokens vs SDPA causal.
Timing: CUDA events, median. ``us`` is GPU time per call, from replays of a
CUDA graph of several calls (how decode runs in the engine); ``eager_us``
times single eager calls, host overhead included.

CPU: decode, SmolLM2's heads (Hq 9, Hkv 3, D 64) and Hq 32, Hkv 8, D 128,
fp32 and bf16, batch 1 x 512 / 2048 and 16, 64 x 512: the C kernel
(``attention_native``, impl "auto") vs the SDPA path it replaced (impl
"torch") vs SDPA on dense K/V, the K/V read from DRAM (copies cycled);
``--threads N`` sets torch's threads (default: torch's). One prefill case.
``--engine``: SmolLM2's engine (the GGUF, packed float32) at batch 1, 16,
64 after 512-token prompts, decode steps with the C kernel and with the SDPA
path alternating in one process (ms per step, median round).

--tune (GPU, a few minutes more): decode at context 4096, ratio to SDPA for
every KV tile / warps / stages choice at batch 8, 64, 256, and for every
split count at batch 1 to 256 with the default tiles: what ``decode_plan``
and ``PROGRAMS_PER_SM`` in kvstrata/kernels/_triton_attention.py should say.

Usage: python tools/bench_attention.py [--quick] [--tune] [--threads N] [--engine]
Never asserts timings.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench_timing import alternate_steps, cpu_time, cuda_eager_time, cuda_graph_time, smollm2_decode_core

from kvstrata.kernels import paged_attention
from kvstrata.logs import configure_logging

MODELS = {"tinyllama_hq32_hkv4_d64": (32, 4, 64), "hq32_hkv8_d128": (32, 8, 128)}
BATCHES = (1, 8, 32, 64, 256)
CONTEXTS = (2048, 4096)
BLOCK_SIZE = 16
CALLS_PER_GRAPH = 10








def make_case(batch: int, ctx: int, q_len: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: str, seed: int = 0) -> dict:
    """Dense K/V [B, Hkv, ctx, D] for SDPA and the same rows in a paged cache
    on shuffled blocks (block 0 is the null block), plus the new tokens' queries."""
    g = torch.Generator(device=device).manual_seed(seed)
    per_seq = ctx // BLOCK_SIZE
    k = torch.randn((batch, kv_heads, ctx, head_dim), generator=g, device=device, dtype=dtype)
    v = torch.randn((batch, kv_heads, ctx, head_dim), generator=g, device=device, dtype=dtype)
    perm = torch.randperm(batch * per_seq, generator=g, device=device) + 1
    kc = torch.zeros((1 + batch * per_seq, BLOCK_SIZE, kv_heads, head_dim), device=device, dtype=dtype)
    vc = torch.zeros_like(kc)
    kc[perm] = k.transpose(1, 2).reshape(batch * per_seq, BLOCK_SIZE, kv_heads, head_dim)
    vc[perm] = v.transpose(1, 2).reshape(batch * per_seq, BLOCK_SIZE, kv_heads, head_dim)
    q = torch.randn((batch, q_heads, q_len, head_dim), generator=g, device=device, dtype=dtype)
    query = q.transpose(1, 2).reshape(batch * q_len, q_heads, head_dim).contiguous()
    return dict(q_dense=q, k_dense=k, v_dense=v, query=query, key_cache=kc, value_cache=vc,
                block_tables=perm.view(batch, per_seq).int(),
                query_start_loc=torch.arange(0, batch * q_len + 1, q_len, device=device, dtype=torch.int32),
                seq_lens=torch.full((batch,), ctx, device=device, dtype=torch.int32), scale=head_dim**-0.5)


def ours(c: dict, num_splits: int | None = None, split_decode: bool = True) -> Callable[[], object]:
    """Our decode: split-K chosen automatically (``split_decode``), the default
    single-pass kernel (``split_decode=False``), or a forced split count."""
    out = torch.empty_like(c["query"])
    args = (c["query"], c["key_cache"], c["value_cache"], c["block_tables"], c["query_start_loc"], c["seq_lens"],
            c["scale"])
    if num_splits is None:
        plans: dict = {}  # one step's metadata (CPU): planned by the first call, as by a model's first layer
        return lambda: paged_attention(*args, out=out, split_decode=split_decode, plans=plans)
    from kvstrata.kernels._triton_attention import paged_attention_triton

    return lambda: paged_attention_triton(*args, None, out, num_splits=num_splits)


def sdpa(c: dict, causal: bool) -> Callable[[], object]:
    q, k, v = c["q_dense"], c["k_dense"], c["v_dense"]
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=c["scale"], enable_gqa=True)


def sdpa_backend(c: dict, causal: bool) -> str:
    """The first backend, in torch's priority order, that takes this call: the one SDPA runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]):
                sdpa(c, causal)()
            return backend.name.lower()
        except Exception:  # noqa: BLE001 - a backend that refuses the call, whatever it raises
            continue
    return "unknown"


def gpu_section(quick: bool) -> dict:
    from kvstrata.kernels._triton_attention import decode_plan

    repeat = 10 if quick else 25
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res: dict = {"device": torch.cuda.get_device_name(), "sms": sms, "decode": {}, "prefill": {}}
    for name, (hq, hkv, d) in MODELS.items():
        for ctx in CONTEXTS:
            for batch in BATCHES:
                c = make_case(batch, ctx, 1, hq, hkv, d, torch.bfloat16, "cuda")
                t_ours, t_sdpa = cuda_graph_time(ours(c), CALLS_PER_GRAPH, repeat), cuda_graph_time(sdpa(c, False), CALLS_PER_GRAPH, repeat)
                kv_bytes = 2 * c["k_dense"].numel() * c["k_dense"].element_size()
                res["decode"][f"{name}_b{batch}_ctx{ctx}"] = {
                    "num_splits": decode_plan(batch, hq, hkv, d, sms).num_splits,
                    "us": t_ours * 1e6, "sdpa_us": t_sdpa * 1e6, "ratio": t_ours / t_sdpa,
                    "no_split_us": cuda_graph_time(ours(c, num_splits=1), CALLS_PER_GRAPH, repeat) * 1e6,
                    "single_pass_us": cuda_graph_time(ours(c, split_decode=False), CALLS_PER_GRAPH, repeat) * 1e6,
                    "kv_GBps": kv_bytes / t_ours / 1e9,
                    "eager_us": cuda_eager_time(ours(c), repeat) * 1e6,
                    "eager_sdpa_us": cuda_eager_time(sdpa(c, False), repeat) * 1e6,
                }
                if batch == BATCHES[0] and ctx == CONTEXTS[0]:
                    res["decode"][f"{name}_sdpa_backend"] = sdpa_backend(c, False)
                del c
        c = make_case(4, 2048, 2048, hq, hkv, d, torch.bfloat16, "cuda")
        t_ours, t_sdpa = cuda_graph_time(ours(c), CALLS_PER_GRAPH, repeat), cuda_graph_time(sdpa(c, True), CALLS_PER_GRAPH, repeat)
        res["prefill"][f"{name}_b4_len2048"] = {"us": t_ours * 1e6, "sdpa_us": t_sdpa * 1e6, "ratio": t_ours / t_sdpa,
                                                "sdpa_backend": sdpa_backend(c, True)}
        del c
    ratios = [r["ratio"] for r in res["decode"].values() if isinstance(r, dict)]
    res["decode_worst_ratio"] = max(ratios)
    return res


def tune_section(repeat: int = 10) -> dict:
    """Ratios to SDPA of explicit decode plans (see the module docstring)."""
    from kvstrata.kernels._triton_attention import decode_plan, launch_decode

    def run(c: dict, plan) -> Callable[[], object]:
        out = torch.empty_like(c["query"])
        return lambda: launch_decode(c["query"], c["key_cache"], c["value_cache"], c["block_tables"],
                                     c["query_start_loc"], c["seq_lens"], c["scale"], None, out, plan, False)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res: dict = {}
    for name, (hq, hkv, d) in MODELS.items():
        cases = {b: make_case(b, 4096, 1, hq, hkv, d, torch.bfloat16, "cuda") for b in BATCHES + (128,)}
        sdpa_s = {b: cuda_graph_time(sdpa(c, False), CALLS_PER_GRAPH, repeat) for b, c in cases.items()}
        res[name] = entry = {"tiles": {}, "splits": {}}
        for tile_n in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (2, 3, 4):
                    row = entry["tiles"][f"tile{tile_n}_warps{warps}_stages{stages}"] = {}
                    for b in (8, 64, 256):
                        plan = decode_plan(b, hq, hkv, d, sms)._replace(tile_n=tile_n, num_warps=warps,
                                                                        num_stages=stages)
                        row[b] = round(cuda_graph_time(run(cases[b], plan), CALLS_PER_GRAPH, repeat) / sdpa_s[b], 3)
        for b, c in sorted(cases.items()):
            plan = decode_plan(b, hq, hkv, d, sms)
            entry["splits"][f"b{b}_auto{plan.num_splits}"] = {
                s: round(cuda_graph_time(run(c, plan._replace(num_splits=s)), CALLS_PER_GRAPH, repeat) / sdpa_s[b], 3)
                for s in (1, 2, 4, 8, 16, 32)}
        del cases
        # each model's sweep at once on stderr: a run cut by a time limit keeps what it measured
        print("bench_attention " + json.dumps({"tune": {name: entry}}), file=sys.stderr, flush=True)
    return res


CPU_MODELS = {"smollm2_hq9_hkv3_d64": (9, 3, 64), "hq32_hkv8_d128": (32, 8, 128)}
CPU_DECODE = ((1, 512), (1, 2048), (16, 512), (64, 512))
COLD_BYTES = 96 << 20  # cycle enough copies of a case that its K/V comes from DRAM, as a model's layers do


def cpu_section(quick: bool) -> dict:
    """Decode on the CPU: the C kernel (``attention_native``, what impl "auto"
    runs) vs the SDPA path it replaced (impl "torch": gathers each sequence's
    blocks, then SDPA) vs SDPA on the same K/V laid out densely (no gather:
    a floor for any SDPA path). Copies of each case are cycled so the K/V is
    read from DRAM, as in a model (one copy per layer). One prefill case."""
    from kvstrata.kernels.attention_native import attention_kernels, attention_status

    attention_kernels()  # built and loaded before anything is timed
    res: dict = {"decode_kernel": attention_status(), "threads": torch.get_num_threads()}
    repeat = 3 if quick else 7
    for model, (hq, hkv, d) in CPU_MODELS.items():
        for dtype in (torch.float32, torch.bfloat16):
            for batch, ctx in CPU_DECODE[:3] if quick else CPU_DECODE:
                kv_bytes = 2 * batch * ctx * hkv * d * dtype.itemsize
                copies = max(1, min(8, -(-COLD_BYTES // kv_bytes)))
                cases = [make_case(batch, ctx, 1, hq, hkv, d, dtype, "cpu", seed=i) for i in range(copies)]
                row = {}
                for name, make in (("native_us", lambda c: ours(c)), ("sdpa_path_us", lambda c: ours_torch(c)),
                                   ("sdpa_dense_us", lambda c: sdpa(c, False))):
                    fns = [make(c) for c in cases]
                    row[name] = cpu_time(lambda: [f() for f in fns], repeat) / copies * 1e6
                row["vs_sdpa_path"] = row["native_us"] / row["sdpa_path_us"]
                row["vs_sdpa_dense"] = row["native_us"] / row["sdpa_dense_us"]
                row["GBps"] = kv_bytes / row["native_us"] / 1e3
                res[f"decode_{model}_{str(dtype).removeprefix('torch.')}_b{batch}_ctx{ctx}"] = row
    c = make_case(1, 128, 128, 4, 2, 64, torch.float32, "cpu")
    t_ours, t_sdpa = cpu_time(ours(c), 10), cpu_time(sdpa(c, True), 10)
    res["prefill_b1_ctx128"] = {"us": t_ours * 1e6, "sdpa_us": t_sdpa * 1e6, "ratio": t_ours / t_sdpa}
    return res


def engine_section(batches: tuple[int, ...], prompt: int, steps: int, rounds: int) -> dict:
    """SmolLM2 (the GGUF, packed float32) decode steps with the C decode kernel
    and with the SDPA path, alternating in one process on the same running
    requests (``rounds`` x ``steps`` steps each; ms/step = the median round).
    The SDPA path is what ``attention._native_decode`` returning None runs:
    everything else in the step is the same code."""
    import kvstrata.kernels.attention as attention_module
    res: dict = {"prompt_tokens": prompt, "threads": torch.get_num_threads()}
    native = attention_module._native_decode

    def use(fn):
        return lambda: setattr(attention_module, "_native_decode", fn)

    for batch in batches:
        try:
            core, _ = smollm2_decode_core(batch, prompt, 2 * rounds * steps)
        except Exception as e:  # noqa: BLE001 - a bench reports what it could not run
            return {"skipped": f"SmolLM2 GGUF not here: {e}"}
        try:
            ms = alternate_steps(core, {"native": use(native), "sdpa_path": use(lambda *a: None)}, steps, rounds)
        finally:
            attention_module._native_decode = native
        row = {f"{k}_ms_per_step": v for k, v in ms.items()}
        row["speedup"] = row["sdpa_path_ms_per_step"] / row["native_ms_per_step"]
        res[f"b{batch}"] = row
    return res


def ours_torch(c: dict) -> Callable[[], object]:
    """The SDPA path of our CPU decode (the torch reference: gather, then SDPA per chunk)."""
    out = torch.empty_like(c["query"])
    args = (c["query"], c["key_cache"], c["value_cache"], c["block_tables"], c["query_start_loc"], c["seq_lens"],
            c["scale"])
    plans: dict = {}
    return lambda: paged_attention(*args, out=out, impl="torch", plans=plans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--tune", action="store_true", help="also sweep decode tiles and split counts (GPU)")
    parser.add_argument("--threads", type=int, help="torch threads (CPU)")
    parser.add_argument("--engine", action="store_true",
                        help="CPU: also SmolLM2 engine decode steps, the C kernel vs the SDPA path")
    args = parser.parse_args()
    configure_logging("WARNING", json=False)  # logs (a kernel build's too) on stderr; stdout is the JSON report
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict = {"torch": torch.__version__, "machine": platform.machine()}
    if torch.cuda.is_available():
        import triton

        report["triton"] = triton.__version__
        report["gpu"] = gpu_section(args.quick)
        if args.tune:
            report["tune"] = tune_section()
    else:
        report["note"] = ("no CUDA device: CPU decode (the C kernel vs the SDPA path and dense SDPA) and one tiny "
                          "prefill; the GPU decode-vs-SDPA goal is measured on a GPU")
        report["cpu"] = cpu_section(args.quick)
        if args.engine:
            report["engine"] = engine_section((1, 16, 64), 512, 4 if args.quick else 8, 3 if args.quick else 5)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
