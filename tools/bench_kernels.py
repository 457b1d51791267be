"""Benchmark kvstrata.kernels; prints one JSON object.

CPU (always): each torch reference path against its dense baseline, measured
in the same run on the same bytes:
  reshape_and_cache  vs  copying the rows into a contiguous tensor
  gather/scatter     vs  a contiguous copy of the same bytes
  paged attention    vs  torch SDPA on the same K/V laid out densely

GPU (only when CUDA is present): compiled Triton kernels
  bandwidth of reshape_and_cache / gather / scatter as a fraction of a
  device-to-device copy of the same bytes (goal >= 0.8), decode attention
  time against SDPA on dense K/V (goal <= 1.25x), and the slowdown of a
  forward pass while every layer's KV is stored on the store stream
  (goal < 5%).

Usage: python tools/bench_kernels.py [--quick] [--threads N]
Never asserts timings.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvstrata.kernels import (
    KVCacheShape,
    KVStreams,
    allocate_kv_caches,
    gather_kv,
    paged_attention,
    reshape_and_cache,
    scatter_kv,
)
from kvstrata.logs import configure_logging


def cpu_time(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs, after one warm-up."""
    fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def gpu_time(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``fn`` on the current CUDA stream (CUDA events)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def paged_setup(seq_lens: list[int], q_lens: list[int], *, block_size: int, q_heads: int, kv_heads: int,
                head_dim: int, dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    """A varlen batch on shuffled blocks, plus the same K/V dense for SDPA."""
    g = torch.Generator().manual_seed(seed)
    blocks = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = 1 + sum(blocks)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32)
    slots = []
    for b, n in enumerate(seq_lens):
        for i in range(blocks[b]):
            table[b, i] = perm.pop()
        pos = torch.arange(n)
        slots.append(table[b, pos // block_size].long() * block_size + pos % block_size)
    slots_all = torch.cat(slots)
    total = len(slots_all)
    k = torch.randn((total, kv_heads, head_dim), generator=g).to(dtype)
    v = torch.randn((total, kv_heads, head_dim), generator=g).to(dtype)
    kc = torch.zeros((num_blocks, block_size, kv_heads, head_dim), dtype=dtype)
    vc = torch.zeros_like(kc)
    reshape_and_cache(k, v, kc, vc, slots_all, impl="torch")
    q = torch.randn((sum(q_lens), q_heads, head_dim), generator=g).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    t = lambda x: x.to(device)  # noqa: E731
    return dict(query=t(q), key_cache=t(kc), value_cache=t(vc), block_tables=t(table), query_start_loc=t(qsl),
                seq_lens=t(torch.tensor(seq_lens, dtype=torch.int32)), dense_k=t(k), dense_v=t(v),
                seq_list=seq_lens, q_lens=q_lens)


def dense_sdpa(s: dict, scale: float) -> Callable[[], object]:
    """The dense baseline: SDPA per group of equal-length sequences, K/V contiguous."""
    starts = [0] + torch.tensor(s["seq_list"]).cumsum(0).tolist()
    qstarts = s["query_start_loc"].tolist()
    seqs = []
    for b, n in enumerate(s["seq_list"]):
        kk = s["dense_k"][starts[b]:starts[b] + n].transpose(0, 1).unsqueeze(0)
        vv = s["dense_v"][starts[b]:starts[b] + n].transpose(0, 1).unsqueeze(0)
        qq = s["query"][qstarts[b]:qstarts[b + 1]].transpose(0, 1).unsqueeze(0)
        seqs.append((qq, kk, vv))
    if all(q == 1 for q in s["q_lens"]) and len(set(s["seq_list"])) == 1:
        q = torch.cat([x[0] for x in seqs])  # decode batch, equal lengths: one batched call
        k = torch.cat([x[1] for x in seqs])
        v = torch.cat([x[2] for x in seqs])
        return lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    def run():
        for q, k, v in seqs:
            # bottom-right causal alignment via an explicit mask when q_len < kv_len
            ql, kl = q.shape[2], k.shape[2]
            if ql == kl:
                F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
                continue
            mask = torch.ones((ql, kl), dtype=torch.bool, device=q.device).tril(kl - ql)
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return run


def attn_fn(s: dict, scale: float, impl: str) -> Callable[[], object]:
    out = torch.empty_like(s["query"])
    return lambda: paged_attention(s["query"], s["key_cache"], s["value_cache"], s["block_tables"],
                                   s["query_start_loc"], s["seq_lens"], scale, out=out, impl=impl)


def cpu_section(quick: bool) -> dict:
    rep = 5 if quick else 20
    res: dict = {"threads": torch.get_num_threads()}
    shape = KVCacheShape(num_layers=4, num_blocks=256, block_size=16, num_kv_heads=4, head_size=64)
    backing, caches = allocate_kv_caches(shape, "per_layer", torch.float32, "cpu")
    backing.normal_()
    n = 512
    slots = torch.randperm(256 * 16)[:n]
    key = torch.randn((n, 4, 64))
    value = torch.randn((n, 4, 64))
    dense_k, dense_v = torch.empty_like(key), torch.empty_like(value)
    t_w = cpu_time(lambda: reshape_and_cache(key, value, *caches[0], slots, impl="torch"), rep)
    t_wd = cpu_time(lambda: (dense_k.copy_(key), dense_v.copy_(value)), rep)
    res["reshape_and_cache"] = {"tokens": n, "ms": t_w * 1e3, "dense_copy_ms": t_wd * 1e3, "ratio": t_w / t_wd}
    chunk_slots = torch.arange(8, 8 + 256)  # a 256-token chunk starting mid-block
    chunk = torch.empty((4, 2, 256, 4, 64))
    src = backing[:, :, :16].reshape(chunk.shape)
    t_g = cpu_time(lambda: gather_kv(caches, chunk_slots, out=chunk, impl="torch"), rep)
    t_s = cpu_time(lambda: scatter_kv(chunk, caches, chunk_slots, impl="torch"), rep)
    t_c = cpu_time(lambda: chunk.copy_(src), rep)
    res["gather_kv"] = {"tokens": 256, "layers": 4, "ms": t_g * 1e3, "dense_copy_ms": t_c * 1e3, "ratio": t_g / t_c}
    res["scatter_kv"] = {"tokens": 256, "layers": 4, "ms": t_s * 1e3, "dense_copy_ms": t_c * 1e3, "ratio": t_s / t_c}
    cases = {
        "decode": ([512] * 16, [1] * 16),
        "prefill": ([512], [512]),
        "extend": ([384, 256], [128, 64]),
    }
    for name, (lens, qls) in cases.items():
        s = paged_setup(lens, qls, block_size=16, q_heads=8, kv_heads=2, head_dim=64, dtype=torch.float32,
                        device="cpu")
        t_p = cpu_time(attn_fn(s, 0.125, "torch"), rep)
        t_d = cpu_time(dense_sdpa(s, 0.125), rep)
        res[f"attention_{name}"] = {"seq_lens": lens[:2] + (["..."] if len(lens) > 2 else []), "q_lens": qls[:2],
                                    "ms": t_p * 1e3, "dense_sdpa_ms": t_d * 1e3, "ratio": t_p / t_d}
    return res


def gpu_bandwidth(quick: bool) -> dict:
    rep = 20 if quick else 100
    res = {}
    dtype = torch.bfloat16
    L, nb, bs, h, d = 32, 4096, 16, 8, 128
    for layout in ("per_layer", "cross_layer"):
        backing, caches = allocate_kv_caches(KVCacheShape(num_layers=L, num_blocks=nb, block_size=bs,
                                                          num_kv_heads=h, head_size=d), layout, dtype, "cuda")
        backing.normal_()
        n = 4096
        slots = torch.randperm(nb * bs, device="cuda")[:n]
        key = torch.randn((n, h, d), device="cuda", dtype=dtype)
        value = torch.randn_like(key)
        nbytes = 2 * key.numel() * key.element_size()
        src = torch.empty(2 * key.numel(), device="cuda", dtype=dtype)
        dst = torch.empty_like(src)
        t_copy = gpu_time(lambda: dst.copy_(src), rep)
        t_w = gpu_time(lambda: reshape_and_cache(key, value, *caches[0], slots), rep)
        entry = {"reshape_and_cache": _bw(nbytes, t_w, t_copy)}
        chunk_slots = torch.arange(8, 8 + 256 * 8, device="cuda")  # 8 chunks of 256 tokens, mid-block start
        chunk = torch.empty((L, 2, chunk_slots.numel(), h, d), device="cuda", dtype=dtype)
        cbytes = chunk.numel() * chunk.element_size()
        csrc, cdst = torch.empty_like(chunk), torch.empty_like(chunk)
        t_ccopy = gpu_time(lambda: cdst.copy_(csrc), rep)
        t_g = gpu_time(lambda: gather_kv(caches, chunk_slots, out=chunk), rep)
        t_s = gpu_time(lambda: scatter_kv(chunk, caches, chunk_slots), rep)
        entry["gather_kv"] = _bw(cbytes, t_g, t_ccopy)
        entry["scatter_kv"] = _bw(cbytes, t_s, t_ccopy)
        res[layout] = entry
        del backing, caches
    return res


def _bw(nbytes: int, t: float, t_copy: float) -> dict:
    return {"bytes": nbytes, "us": t * 1e6, "GBps": nbytes / t / 1e9, "d2d_copy_GBps": nbytes / t_copy / 1e9,
            "fraction_of_copy": t_copy / t}


def gpu_decode(quick: bool) -> dict:
    rep = 20 if quick else 100
    res = {}
    for batch, ctx in ((8, 2048), (32, 2048), (64, 4096)):
        s = paged_setup([ctx] * batch, [1] * batch, block_size=16, q_heads=32, kv_heads=8, head_dim=128,
                        dtype=torch.float16, device="cuda")
        t_p = gpu_time(attn_fn(s, 0.088, "auto"), rep)
        t_d = gpu_time(dense_sdpa(s, 0.088), rep)
        res[f"b{batch}_ctx{ctx}"] = {"triton_us": t_p * 1e6, "sdpa_us": t_d * 1e6, "ratio": t_p / t_d}
    return res


def gpu_store_interference(quick: bool) -> dict:
    """A layer-by-layer forward pass proxy (matmuls + cache write + attention),
    alone and with every layer's new KV stored to pinned host memory on the store stream."""
    L, h, d, hidden, tokens = 16, 8, 128, 4096, 2048
    dtype = torch.bfloat16
    shape = KVCacheShape(num_layers=L, num_blocks=1024, block_size=16, num_kv_heads=h, head_size=d)
    backing, caches = allocate_kv_caches(shape, "per_layer", dtype, "cuda")
    streams = KVStreams("cuda", num_layers=L)
    w = torch.randn((hidden, hidden), device="cuda", dtype=dtype) / hidden**0.5
    x0 = torch.randn((tokens, hidden), device="cuda", dtype=dtype)
    slots = torch.arange(tokens, device="cuda")
    hosts = [streams.alloc_host((2, tokens, h, d), dtype) for _ in range(L)]
    table = torch.arange(tokens // 16, device="cuda", dtype=torch.int32).unsqueeze(0)
    qsl = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
    lens = torch.tensor([tokens], device="cuda", dtype=torch.int32)

    def forward(store: bool):
        x = x0
        for layer in range(L):
            for _ in range(4):
                x = x @ w
            kv = x[:, : h * d].reshape(tokens, h, d)
            reshape_and_cache(kv, kv, *caches[layer], slots)
            paged_attention(x[:, : 4 * h * d].reshape(tokens, 4 * h, d), *caches[layer], table, qsl, lens, 0.088)
            if store:
                streams.store_layer(layer, *caches[layer], slots, host_out=hosts[layer])
        return x

    rep = 5 if quick else 20
    t_alone = gpu_time(lambda: forward(False), rep)
    t_store = gpu_time(lambda: (forward(True), streams.synchronize()), rep)
    t_fwd_only_with_store = gpu_time(lambda: forward(True), rep)
    streams.synchronize()
    stored = L * 2 * tokens * h * d * 2
    return {"layers": L, "tokens": tokens, "forward_ms": t_alone * 1e3,
            "forward_with_store_ms": t_fwd_only_with_store * 1e3,
            "forward_plus_store_drain_ms": t_store * 1e3, "slowdown": t_fwd_only_with_store / t_alone - 1.0,
            "stored_bytes": stored}


def main() -> None:
    configure_logging("WARNING", json=False)  # logs on stderr; stdout is the JSON report
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's own; 1 gives stable numbers on a shared machine)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    report: dict = {"torch": torch.__version__, "machine": platform.machine(), "cpu": cpu_section(args.quick)}
    if torch.cuda.is_available():
        report["gpu"] = {"device": torch.cuda.get_device_name(),
                         "bandwidth": gpu_bandwidth(args.quick),
                         "decode_attention": gpu_decode(args.quick),
                         "store_interference": gpu_store_interference(args.quick)}
    else:
        report["gpu"] = None
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
