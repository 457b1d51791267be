"""Benchmark kvstrata.kernels; prints one JSON object.

CPU (always): each torch reference path against its dense baseline, measured
in the same run on the same bytes:
  reshape_and_cache  vs  copying the rows into a contiguous tensor
  gather/scatter     vs  a contiguous copy of the same bytes
  paged attention    vs  torch SDPA on the same K/V laid out densely

GPU (only when CUDA is present), TinyLlama-like shapes (22 layers, Hkv=4,
D=64, block size 16, bf16), everything measured in the same run:
  copy_vs_d2d         reshape_and_cache (one layer) / gather_kv / scatter_kv
                      (all layers) for 64..4096 tokens, both cache layouts,
                      as a fraction of a device-to-device copy of the same
                      bytes, both timed as CUDA-graph replays (goal >= 0.8)
  store_interference  slowdown of a TinyLlama-like forward pass while every
                      layer's new KV is stored to pinned host memory on the
                      store stream (goal < 3%), for the default store
                      configuration and two alternatives
  decode_attention    paged decode attention against SDPA on dense K/V
  summary             the goals at a glance

Both (CPU: 4 layers, small chunks; GPU: TinyLlama-like):
  layer_transfers     one step's layer-by-layer loads and saves of S chunks
                      (the offload connector's CPU-tier hits and filled
                      chunks): one KVStreams call per chunk and layer
                      against one per layer (``*_layer_segments``); host ms
                      to issue them and wall ms until done

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

from bench_timing import cpu_time, cuda_eager_time, cuda_graph_time, host_launch_time

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


def layer_transfers(quick: bool, device: str) -> dict:
    """Host ms to issue, and wall ms to finish, one step's layer transfers of
    ``chunks`` chunks per layer, as the offload worker issues them: per chunk
    (one ``load_layer_segments`` / ``store_layer_segments`` call per chunk,
    its slots on the host) vs batched (one call per layer, slots on the device)."""
    cuda = device == "cuda"
    layers, heads, dim, tokens, chunks = (TINY["layers"], TINY["kv_heads"], TINY["head_dim"], 256, 12) if cuda \
        else (4, 4, 64, 64, 8)
    dtype = torch.bfloat16 if cuda else torch.float32
    num_blocks = chunks * tokens // 16 * 2 + 1
    shape = KVCacheShape(num_layers=layers, num_blocks=num_blocks, block_size=16, num_kv_heads=heads, head_size=dim)
    backing, caches = allocate_kv_caches(shape, "per_layer", dtype, device)
    backing.normal_()
    streams = KVStreams(device, layers)
    gen = torch.Generator().manual_seed(0)
    slots = block_slots(chunks * tokens, num_blocks, 16, gen)
    per_chunk_slots = list(slots.split(tokens))  # host tensors, as the worker hands them over
    dev_slots = slots.to(device)  # the batched path's: copied once per step
    bufs = [streams.alloc_host((layers, 2, tokens, heads, dim), dtype) for _ in range(chunks)]

    def finish() -> None:
        for layer in range(layers):
            streams.wait_layer_loaded(layer)
        streams.synchronize()
        if cuda:
            torch.cuda.synchronize()

    def load_per_chunk() -> None:
        for layer, (k, v) in enumerate(caches):
            for b, sl in zip(bufs, per_chunk_slots, strict=True):
                streams.load_layer_segments(layer, [b[layer]], k, v, sl)

    def load_batched() -> None:
        for layer, (k, v) in enumerate(caches):
            streams.load_layer_segments(layer, [b[layer] for b in bufs], k, v, dev_slots)

    def store_per_chunk() -> None:
        for layer, (k, v) in enumerate(caches):
            for b, sl in zip(bufs, per_chunk_slots, strict=True):
                streams.store_layer_segments(layer, k, v, sl, [b[layer]])

    def store_batched() -> None:
        for layer, (k, v) in enumerate(caches):
            streams.store_layer_segments(layer, k, v, dev_slots, [b[layer] for b in bufs])

    reps = 3 if quick else 10
    res: dict = {"device": device, "layers": layers, "chunks": chunks, "chunk_tokens": tokens,
                 "bytes_per_step": chunks * tokens * layers * 2 * heads * dim * backing.element_size()}
    for name, fn in (("load_per_chunk", load_per_chunk), ("load_batched", load_batched),
                     ("store_per_chunk", store_per_chunk), ("store_batched", store_batched)):
        fn()
        finish()
        host, wall = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            finish()
            host.append(t1 - t0)
            wall.append(time.perf_counter() - t0)
        res[name] = {"host_ms": round(statistics.median(host) * 1e3, 3), "wall_ms": round(statistics.median(wall) * 1e3, 3)}
    for kind in ("load", "store"):
        a, b = res[f"{kind}_per_chunk"], res[f"{kind}_batched"]
        res[f"{kind}_per_chunk_over_batched"] = {k: round(a[k] / max(b[k], 1e-9), 2) for k in ("host_ms", "wall_ms")}
    return res


# TinyLlama-1.1B-like geometry: the realistic shapes of the GPU section.
TINY = dict(layers=22, kv_heads=4, head_dim=64, block_size=16, q_heads=32, hidden=2048, inter=5632)






def block_slots(n: int, num_blocks: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """Slots of ``n`` tokens laid over shuffled blocks (block 0 kept as the null block)."""
    need = (n + block_size - 1) // block_size
    blocks = torch.randperm(num_blocks - 1, generator=gen)[:need] + 1
    return (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]


def gpu_copy_fractions(quick: bool) -> dict:
    """reshape_and_cache (one layer), gather_kv / scatter_kv (all layers) as a
    fraction of a device-to-device copy of the same bytes, both timed as
    CUDA-graph replays in this run (goal >= 0.8)."""
    L, h, d, bs = TINY["layers"], TINY["kv_heads"], TINY["head_dim"], TINY["block_size"]
    dtype, dev = torch.bfloat16, "cuda"
    tokens = (64, 512, 4096) if quick else (64, 256, 1024, 4096)
    num_blocks = 1 + 2 * max(tokens) // bs
    gen = torch.Generator().manual_seed(0)
    res: dict = {"shape": dict(TINY, dtype="bf16"), "timing": "CUDA graph replay, median per call"}
    for layout in ("per_layer", "cross_layer"):
        backing, caches = allocate_kv_caches(
            KVCacheShape(num_layers=L, num_blocks=num_blocks, block_size=bs, num_kv_heads=h, head_size=d),
            layout, dtype, dev)
        backing.normal_()
        rows = {}
        for n in tokens if layout == "per_layer" or not quick else tokens[-1:]:
            slots = block_slots(n, num_blocks, bs, gen).to(dev)
            slots[::61] = -1  # a little padding, as in a batch
            # K/V as the model makes them: slices of one fused qkv projection
            qkv = torch.randn((n, (TINY["q_heads"] + 2 * h) * d), device=dev, dtype=dtype)
            key = qkv[:, TINY["q_heads"] * d:(TINY["q_heads"] + h) * d].view(n, h, d)
            value = qkv[:, (TINY["q_heads"] + h) * d:].view(n, h, d)
            chunk = torch.empty((L, 2, n, h, d), device=dev, dtype=dtype)
            entry = {
                "reshape_and_cache": _fraction(lambda: reshape_and_cache(key, value, *caches[0], slots),
                                               2 * n * h * d * 2),
                "gather_kv": _fraction(lambda: gather_kv(caches, slots, out=chunk), chunk.numel() * 2),
                "scatter_kv": _fraction(lambda: scatter_kv(chunk, caches, slots), chunk.numel() * 2),
            }
            rows[f"tokens_{n}"] = entry
        res[layout] = rows
        del backing, caches
        torch.cuda.empty_cache()
    return res


def _fraction(fn: Callable[[], object], nbytes: int) -> dict:
    src = torch.empty(nbytes, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    t_copy = cuda_graph_time(lambda: dst.copy_(src), 20, 15)
    t = cuda_graph_time(fn, 20, 15)
    return {"bytes": nbytes, "us": round(t * 1e6, 2), "d2d_copy_us": round(t_copy * 1e6, 2),
            "GBps": round(2 * nbytes / t / 1e9, 1), "fraction_of_copy": round(t_copy / t, 3),
            "host_us": round(host_launch_time(fn) * 1e6, 1)}


def gpu_decode(quick: bool) -> dict:
    rep = 20 if quick else 100
    res = {}
    for batch, ctx in ((8, 2048), (32, 2048), (64, 4096)):
        s = paged_setup([ctx] * batch, [1] * batch, block_size=16, q_heads=32, kv_heads=8, head_dim=128,
                        dtype=torch.float16, device="cuda")
        t_p = cuda_eager_time(attn_fn(s, 0.088, "auto"), rep)
        t_d = cuda_eager_time(dense_sdpa(s, 0.088), rep)
        res[f"b{batch}_ctx{ctx}"] = {"triton_us": t_p * 1e6, "sdpa_us": t_d * 1e6, "ratio": t_p / t_d}
    return res


class ForwardProxy:
    """A TinyLlama-like forward pass over ``tokens`` new tokens (fused qkv, the
    cache write, causal attention, o-proj, SwiGLU MLP per layer), optionally
    storing every layer's new KV to pinned host memory on the store stream,
    as the connector's layerwise saves do (host slot mappings included)."""

    def __init__(self, tokens: int, streams: KVStreams) -> None:
        L, h, d, bs = TINY["layers"], TINY["kv_heads"], TINY["head_dim"], TINY["block_size"]
        hid, hq, inter = TINY["hidden"], TINY["q_heads"], TINY["inter"]
        dtype, dev = torch.bfloat16, "cuda"
        self.tokens, self.streams = tokens, streams
        num_blocks = 1 + 2 * tokens // bs
        self.backing, self.caches = allocate_kv_caches(
            KVCacheShape(num_layers=L, num_blocks=num_blocks, block_size=bs, num_kv_heads=h, head_size=d),
            "per_layer", dtype, dev)
        g = torch.Generator(device=dev).manual_seed(0)
        w = lambda i, o: torch.randn((i, o), device=dev, dtype=dtype, generator=g) / i**0.5  # noqa: E731
        self.w_qkv, self.w_o, self.w_gu, self.w_d = w(hid, (hq + 2 * h) * d), w(hid, hid), w(hid, 2 * inter), w(inter, hid)
        self.x0 = torch.randn((tokens, hid), device=dev, dtype=dtype, generator=g)
        host_slots = block_slots(tokens, num_blocks, bs, torch.Generator().manual_seed(1))
        self.host_slots = host_slots  # on the host, as the connector hands them over
        self.slots = host_slots.to(dev)
        self.hosts = [streams.alloc_host((2, tokens, h, d), dtype) for _ in range(L)]

    def __call__(self, store: bool) -> torch.Tensor:
        T, h, d, hq, inter = self.tokens, TINY["kv_heads"], TINY["head_dim"], TINY["q_heads"], TINY["inter"]
        x = self.x0
        for layer, (kc, vc) in enumerate(self.caches):
            qkv = x @ self.w_qkv
            q = qkv[:, : hq * d].view(T, hq, d).transpose(0, 1)
            k = qkv[:, hq * d:(hq + h) * d].view(T, h, d)
            v = qkv[:, (hq + h) * d:].view(T, h, d)
            reshape_and_cache(k, v, kc, vc, self.slots)
            kk = k.transpose(0, 1).repeat_interleave(hq // h, dim=0)
            vv = v.transpose(0, 1).repeat_interleave(hq // h, dim=0)
            attn = F.scaled_dot_product_attention(q[None], kk[None], vv[None], is_causal=True)[0]
            x = x + attn.transpose(0, 1).reshape(T, hq * d) @ self.w_o
            gu = x @ self.w_gu
            x = x + (F.silu(gu[:, :inter]) * gu[:, inter:]) @ self.w_d
            if store:
                self.streams.store_layer(layer, kc, vc, self.host_slots, host_out=self.hosts[layer])
        return x


def _timed_forwards(fwd: ForwardProxy, store: bool, reps: int, stream: torch.cuda.Stream,
                    sleep_cycles: int = 0) -> dict:
    """Device ms of the forward on ``stream`` (events on it), host ms to issue it,
    and ms until the last store is done; stores drained between reps. With
    ``sleep_cycles`` the stream first sleeps while the host queues the whole
    forward, so the device time excludes host overhead (GPU-side interference only)."""
    dev_ms, host_ms, drain_ms = [], [], []
    with torch.cuda.stream(stream):
        for i in range(reps + 2):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)
            t0 = time.perf_counter()
            start.record()
            fwd(store)
            end.record()
            t1 = time.perf_counter()
            end.synchronize()
            t2 = time.perf_counter()
            fwd.streams.synchronize()
            t3 = time.perf_counter()
            if i >= 2:  # two warm-ups
                dev_ms.append(start.elapsed_time(end))
                host_ms.append((t1 - t0) * 1e3)
                drain_ms.append((t3 - t2) * 1e3)
    return {"ms": dev_ms, "host_ms": host_ms, "drain_ms": drain_ms}


def _sleep_cycles_per_ms() -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _ab(fwd: ForwardProxy, reps: int, stream: torch.cuda.Stream, sleep_cycles: int) -> dict:
    """Forward alone (A) and with stores (B), alternating blocks against drift."""
    runs: dict = {False: {"ms": [], "host_ms": [], "drain_ms": []}, True: {"ms": [], "host_ms": [], "drain_ms": []}}
    for _ in range(2):
        for store in (False, True):
            for k, v in _timed_forwards(fwd, store, reps, stream, sleep_cycles).items():
                runs[store][k].extend(v)
    med = {store: {k: statistics.median(v) for k, v in r.items()} for store, r in runs.items()}
    return {"forward_ms": round(med[False]["ms"], 3), "forward_with_store_ms": round(med[True]["ms"], 3),
            "slowdown": round(med[True]["ms"] / med[False]["ms"] - 1.0, 4),
            "host_issue_ms": round(med[False]["host_ms"], 3),
            "host_issue_with_store_ms": round(med[True]["host_ms"], 3),
            "store_drain_after_forward_ms": round(med[True]["drain_ms"], 3)}


def gpu_store_interference(quick: bool, variants: dict[str, dict] | None = None,
                           token_counts: tuple[int, ...] | None = None) -> dict:
    """Slowdown of the forward pass while every layer's KV is stored on the
    store stream (goal < 3%), per variant: the engine's default (one gather
    program per tile, compute at the default priority), gathers on a bounded
    grid of 8 looping programs, and compute on a high-priority stream.

    ``queued``: the host queues the whole forward behind a device sleep, so
    the time is the device's alone: what the store takes from compute.
    ``eager``: as issued, host overhead included (the store's host cost shows
    here when the forward is host-bound: compare host_issue_ms with forward_ms)."""
    reps = 5 if quick else 15
    variants = variants or {
        "default": dict(store_programs=None, priority=0),
        "bounded_grid_store": dict(store_programs=8, priority=0),
        "high_priority_compute": dict(store_programs=None, priority=-1),
    }
    res: dict = {}
    for tokens in token_counts or ((1024, 4096) if quick else (512, 1024, 2048, 4096)):
        entry: dict = {"stored_MiB": round(TINY["layers"] * 2 * tokens * TINY["kv_heads"] * TINY["head_dim"] * 2
                                           / 2**20, 1)}
        for name, v in variants.items():
            streams = KVStreams("cuda", num_layers=TINY["layers"], store_programs=v["store_programs"])
            fwd = ForwardProxy(tokens, streams)
            stream = torch.cuda.Stream(priority=v["priority"])
            eager = _ab(fwd, reps, stream, 0)
            # the sleep counts SM cycles: calibrate now, at the clocks the forward runs at
            lead_ms = 2.0 * max(eager["host_issue_ms"], eager["host_issue_with_store_ms"]) + 2.0
            queued = _ab(fwd, reps, stream, int(lead_ms * _sleep_cycles_per_ms()))
            store_host = host_launch_time(lambda: streams.store_layer(0, *fwd.caches[0], fwd.host_slots,
                                                                host_out=fwd.hosts[0]), calls=20)
            streams.synchronize()
            entry[name] = {"store_programs": v["store_programs"], "compute_priority": v["priority"],
                           "slowdown": queued["slowdown"], "queued": dict(queued, lead_ms=round(lead_ms, 1)),
                           "eager": eager,
                           "store_layer_host_us": round(store_host * 1e6, 1)}
            del fwd, streams
            torch.cuda.empty_cache()
        res[f"tokens_{tokens}"] = entry
    return res


def _summary(gpu: dict) -> dict:
    """The goals at a glance: worst fraction of a device copy per kernel, and
    the default configuration's forward slowdown per token count."""
    worst: dict = {}
    for layout in ("per_layer", "cross_layer"):
        for row in gpu["copy_vs_d2d"][layout].values():
            for kernel, r in row.items():
                worst[kernel] = min(worst.get(kernel, 1e9), r["fraction_of_copy"])
    rows = {k: v["default"] for k, v in gpu["store_interference"].items() if k.startswith("tokens_")}
    return {"min_fraction_of_copy": worst, "goal_fraction": 0.8,
            "store_slowdown": {k: r["slowdown"] for k, r in rows.items()},
            "store_slowdown_eager": {k: r["eager"]["slowdown"] for k, r in rows.items()}, "goal_slowdown": 0.03}


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
    report["cpu"]["layer_transfers"] = layer_transfers(args.quick, "cpu")
    if torch.cuda.is_available():
        t0 = time.perf_counter()
        report["gpu"] = {"device": torch.cuda.get_device_name(),
                         "copy_vs_d2d": gpu_copy_fractions(args.quick),
                         "store_interference": gpu_store_interference(args.quick)}
        try:
            report["gpu"]["layer_transfers"] = layer_transfers(args.quick, "cuda")
        except Exception as e:  # a path no GPU run has verified yet: report, don't lose the rest
            report["gpu"]["layer_transfers"] = {"error": repr(e)}
        try:
            report["gpu"]["decode_attention"] = gpu_decode(args.quick)
        except Exception as e:  # another team's kernel: report, don't lose the numbers above
            report["gpu"]["decode_attention"] = {"error": repr(e)}
        report["gpu"]["seconds"] = round(time.perf_counter() - t0, 1)
        report["gpu"]["summary"] = _summary(report["gpu"])
    else:
        report["gpu"] = None
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
