"""The engine on a GPU, on a random checkpoint of TinyLlama-1.1B's shape
(prints one JSON object; never asserts).

Sections (``--sections a,b``; ``config`` always runs). Each runs in its own
try: an error is recorded as a string in its ``error`` (a graphs-off/on half
has its own) and the rest still run. Each finished section is also written
to stderr as one line, ``bench_gpu {"name": {...}}``, so a killed run still
shows what it measured. Times are host clocks, with a CUDA synchronize at the
boundaries only; the model step is the engine's (AsyncEngine.generate).

    config                 device, versions, model shape, dtype, workload, command line
    copy_bandwidth         device-to-device copy GB/s (bytes read + written), a read-only
                           sum's GB/s, and the single-stream decode limit they imply:
                           bytes/s / weight bytes read per decode step
    model                  the checkpoint: transformers' LlamaForCausalLM from a config,
                           seeded, built on the device, saved as safetensors (no tokenizer:
                           the engine runs byte-level, prompts are token ids)
    first_long_prompt_s    a fresh engine: TTFT of its first 3,072-token prompt vs the next
                           (run first of the engine sections: no kernel compiled in-process yet)
    decode_single_stream   512-token prompt -> 128 tokens, greedy, EOS ignored:
                           (tokens - 1) / (last token - first token), cuda_graphs off / on
    batch_64x512_128       N prompts at once -> 128 tokens each: output tok/s over the wall
    batch_256x512_128        time, TTFT, steady decode tok/s, graphs off / on
    profile_decode_step    torch.profiler over ~20 decode steps of a 64-request batch in the
                           step thread: kernels, host launches, graph launches per step, GPU
                           busy fraction, HtoD copies (pageable?), host syncs per step
    batch_64_served        batch_64x512_128's pipelined run with the engine in its own process
                           over ZMQ, as ``kvstrata serve`` runs it (text and streams in this
                           process): output and steady decode tok/s, and the GPU busy share of
                           its decode step (profile_decode_step's GPU time per step over it)
    transformers_generate  transformers' generate_batch (else, and on a CPU, batched generate)
                           on the same 64 prompts and weights: output tok/s over its requests'
                           creation to last finish (its per-call set-up left out, as our engine
                           start is), and ours / theirs
    shared_prefix_ttft     sequential requests sharing a 2,048-token prefix: TTFT p50 with
                           prefix caching on vs off
    tiers                  tools/bench_tiers.py's workload (12 chats x 5 turns, 3k-token first
                           turns, concurrency 4, working set 3x the pool): later-turn TTFT p50,
                           recompute (also with the tiers' saves: role producer) vs device +
                           CPU tier, the tier's layer loads batched per layer (the default) and
                           staged (staged_layer_transfers); the connector's default 256-token
                           chunks on CUDA

graphs_off is ``model.cuda_graphs=False`` (the eager baseline), graphs_on
``True``, both with ``scheduler.pipelined_steps`` off; pipelined is graphs on
with async scheduling and pipelined steps (step N+1 launched before N's
tokens are read back: the engine's default on CUDA; compare it with
graphs_on, whose async scheduling is also the default there). On a machine without CUDA the model is tiny (hidden 64, 2 layers,
vocab 512, fp32), every count small and graphs_on the engine's default (off
there), so the whole tool runs in seconds (its test does this); those
figures say only that the code paths work. A section still running when
``--time-budget-s`` runs out is cut and says so; later ones are skipped.

    python tools/bench_gpu.py [--quick] [--sections a,b,c] [--device auto|cuda|cpu]
                              [--shape auto|tinyllama|tiny] [--time-budget-s S]
                              [--fused-kernels default|on|off] [--split-decode default|on|off]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import inspect
import json
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvstrata.connector.offload.options import OffloadOptions
from kvstrata.enginecore.async_engine import AsyncEngine, run
from kvstrata.enginecore.client import EngineClient
from kvstrata.logs import configure_logging
from kvstrata.types import SamplingParams

SECTIONS = ("config", "copy_bandwidth", "model", "decode_single_stream", "batch_64x512_128", "batch_256x512_128",
            "transformers_generate", "shared_prefix_ttft", "profile_decode_step", "batch_64_served",
            "first_long_prompt_s", "tiers")
# Engine sections run in this order: a fresh engine's first prompt must come before any other
# engine has compiled kernels in this process; the shared graphs-off/on engines close before
# transformers runs (it sizes its cache from free memory).
ORDER = ("config", "copy_bandwidth", "model", "first_long_prompt_s", "decode_single_stream", "batch_64x512_128",
         "batch_256x512_128", "profile_decode_step", "batch_64_served", "transformers_generate",
         "shared_prefix_ttft", "tiers")
NEEDS_MODEL = frozenset(SECTIONS) - {"config", "copy_bandwidth", "model"}
MODES = ("graphs_off", "graphs_on", "pipelined")
FUSED = {"default": None, "on": True, "off": False}  # --fused-kernels / --split-decode -> the model's switch

TINYLLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


@dataclass(frozen=True)
class Counts:
    """The workload: full on a GPU, fewer repeats with --quick, tiny on a CPU."""

    prompt_len: int = 512
    new_tokens: int = 128
    single_runs: int = 3
    batch_sizes: tuple[int, int] = (64, 256)
    profile_requests: int = 64
    profile_steps: int = 20
    prefix_len: int = 2048
    unique_len: int = 64
    prefix_requests: int = 32
    long_prompt: int = 3072
    long_prompts: int = 4  # the first, then the next ones
    tiers: dict[str, int] = field(default_factory=lambda: dict(
        conversations=12, turns=5, first_turn_tokens=3072, user_tokens=32, output_tokens=16, concurrency=4))
    tiers_working_set_ratio: float = 3.0
    kv_mib: int = 16384  # the shared engines' pool: 256 x 640 tokens need ~3.5 GiB at TinyLlama's 22 KiB/token
    small_kv_mib: int = 4096  # engines serving one request at a time
    max_batched_tokens: int = 8192  # a 3,072-token prompt, or 16 of the 512-token ones, in one step
    copy_bytes: int = 1 << 30
    copy_iters: int = 20


def make_counts(device: str, quick: bool) -> Counts:
    if device == "cpu":
        return Counts(prompt_len=32, new_tokens=8, single_runs=1, batch_sizes=(4, 8), profile_requests=4,
                      profile_steps=4, prefix_len=64, unique_len=8, prefix_requests=3, long_prompt=256,
                      long_prompts=3, tiers=dict(conversations=6, turns=3, first_turn_tokens=64, user_tokens=8,
                                                 output_tokens=4, concurrency=2),
                      kv_mib=64, small_kv_mib=64, max_batched_tokens=2048, copy_bytes=64 << 20, copy_iters=3)
    if quick:
        return Counts(single_runs=1, profile_steps=10, prefix_requests=8, long_prompts=3, copy_iters=10,
                      # 12 chats keep the working set 3x the pool (it holds `concurrency` whole chats)
                      tiers=dict(conversations=12, turns=2, first_turn_tokens=3072, user_tokens=32,
                                 output_tokens=16, concurrency=4))
    return Counts()


@dataclass
class Bench:
    """Owns: the run's settings, the checkpoint directory and its transformers
    model, the shared engines, the report (sections in SECTIONS order) and the
    deadline every section checks."""

    args: argparse.Namespace
    device: str  # "cuda" or "cpu"
    shape: dict[str, int]
    dtype: str
    counts: Counts
    deadline: float
    report: dict[str, Any]
    model_dir: str | None = None
    hf_model: Any = None
    engines: Engines | None = None
    ours_batch_tokens: dict[str, list[list[int]]] = field(default_factory=dict)
    engines_started: int = 0
    triton_cache_entries: int | None = None

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


# -- helpers ---------------------------------------------------------------------

def _err(exc: BaseException) -> str:
    traceback.print_exception(exc, file=sys.stderr)
    return f"{type(exc).__name__}: {exc}"


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 3)


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def rand_prompts(seed: int, count: int, length: int, vocab: int) -> list[list[int]]:
    """Token ids in [3, vocab): never BOS/EOS of the checkpoint (1, 2), no prefix shared by chance."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def batch_prompts(b: Bench, n: int) -> list[list[int]]:
    """The batch section's prompts for ``n`` requests (the transformers section reuses the first size's)."""
    return rand_prompts(1000 + n, n, b.counts.prompt_len, b.shape["vocab_size"])


def kv_bytes_per_token(shape: dict[str, int], dtype: str) -> int:
    head = shape["hidden_size"] // shape["num_attention_heads"]
    return shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * head * _elem(dtype)


def _elem(dtype: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]


def weight_bytes(shape: dict[str, int], dtype: str) -> dict[str, int]:
    """Parameter bytes in all, and those one decode step reads: everything but
    the embedding table, of which a step reads one row per token (untied lm_head)."""
    h, v, i, n = shape["hidden_size"], shape["vocab_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    params = 2 * v * h + n * layer + h  # TinyLlama's: 1,100,048,384
    e = _elem(dtype)
    return {"params": params, "total_bytes": params * e, "decode_step_bytes": (params - v * h) * e}


@dataclass
class Timing:
    t0: float
    first: float | None = None
    last: float | None = None
    end: float = 0.0
    tokens: list[int] = field(default_factory=list)
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    cached: int = 0

    @property
    def ttft(self) -> float:
        return (self.first or self.end) - self.t0


async def timed(engine: EngineClient, prompt: list[int], params: SamplingParams,
                on_token: Callable[[int], None] | None = None) -> Timing:
    """One request through ``generate``; the time of every delta that carried tokens."""
    t = Timing(time.perf_counter())
    async for out in engine.generate(prompt, params):
        if out.finish_reason == "error":
            raise RuntimeError(f"request failed: {out.error}")
        t.cached = max(t.cached, out.num_cached_tokens)
        if out.new_token_ids:
            now = time.perf_counter()
            if t.first is None:
                t.first = now
            t.last = now
            t.tokens.extend(out.new_token_ids)
            t.arrivals.append((now, len(out.new_token_ids)))
            if on_token is not None:
                on_token(len(t.tokens))
    t.end = time.perf_counter()
    return t


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def graphs_setting(b: Bench, mode: str) -> bool | None:
    """graphs_off: False (the eager baseline); graphs_on: True on CUDA. On a CPU
    "on" is the engine's default (None: off there), whatever True would do."""
    if mode == "graphs_off":
        return False  # graphs_on and pipelined: on
    return True if b.cuda else None


def engine_config(b: Bench, *, graphs: bool | None, caching: bool = True, max_num_seqs: int = 256,
                  kv_mib: int | None = None, pipelined: bool = False) -> EngineConfig:
    threads = b.args.torch_threads or (1 if not b.cuda else None)
    return EngineConfig(
        model=ModelConfig(model=b.model_dir, dtype=b.dtype, cuda_graphs=graphs, num_threads=threads,
                          fused_kernels=FUSED[b.args.fused_kernels], split_decode=FUSED[b.args.split_decode]),
        cache=CacheConfig(kv_cache_memory_mib=kv_mib or b.counts.kv_mib, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=b.counts.max_batched_tokens,
                                  **({"async_scheduling": True, "pipelined_steps": True} if pipelined
                                     else {"pipelined_steps": False})),
        device=b.device, log_level="WARNING")


async def start_engine(b: Bench, config: EngineConfig) -> AsyncEngine:
    b.engines_started += 1
    return await AsyncEngine.start(config)


async def close_engine(b: Bench, engine: AsyncEngine | None) -> None:
    if engine is not None:
        await engine.aclose()
    b.free()


async def warm(engine: EngineClient, b: Bench, n: int) -> None:
    """``n`` short requests at once: the decode batch size the section will run
    (its kernels, or its captured graph) is met once before any timing."""
    prompts = rand_prompts(7 + n, n, 16, b.shape["vocab_size"])
    await asyncio.gather(*(timed(engine, p, greedy(4)) for p in prompts))


class Engines:
    """Owns: the engines the graphs-off/on sections share (decode, batches,
    profile), one per mode, opened on first use and closed together; a mode
    whose start failed keeps its error (not retried)."""

    def __init__(self, b: Bench) -> None:
        self._b = b
        self._open: dict[str, AsyncEngine] = {}
        self._failed: dict[str, BaseException] = {}
        self.start_s: dict[str, float] = {}

    async def get(self, mode: str) -> AsyncEngine:
        if mode in self._failed:
            raise RuntimeError(f"engine start failed earlier: {self._failed[mode]}")
        if mode not in self._open:
            b = self._b
            t0 = time.perf_counter()
            try:
                engine = await start_engine(b, engine_config(b, graphs=graphs_setting(b, mode),
                                                             pipelined=mode == "pipelined"))
            except BaseException as exc:
                self._failed[mode] = exc
                raise
            self._open[mode] = engine
            await warm(engine, b, 1)
            self.start_s[mode] = round(time.perf_counter() - t0, 2)
        return self._open[mode]

    async def aclose(self) -> None:
        if not self._open:
            return
        engines, self._open = list(self._open.values()), {}
        for engine in engines:
            with contextlib.suppress(Exception):
                await engine.aclose()
        engines.clear()  # no reference left: free() gives their memory back to the driver
        self._b.free()


# What the runner's decode graphs (``kvstrata.worker.cuda_graphs.DecodeGraphs``) say of
# themselves: information only, so read leniently (None when absent), never failing a section.

def graph_replays(engine: AsyncEngine) -> int | None:
    """Decode-graph replays so far; None when the runner has no graphs."""
    return getattr(getattr(engine.core.runner, "graphs", None), "num_replays", None)


def graph_info(engine: AsyncEngine) -> dict | None:
    graphs = getattr(engine.core.runner, "graphs", None)
    if graphs is None:
        return None
    sizes = list(getattr(graphs, "sizes", None) or [])
    mem = getattr(graphs, "memory_bytes", None)
    return {"sizes": len(sizes), "largest": max(sizes, default=0),
            "capture_s": _r(getattr(graphs, "capture_s", None), 2),
            "memory_mib": None if mem is None else round(mem / 2**20, 1)}


def _delta(after: int | None, before: int | None) -> int | None:
    return None if after is None or before is None else after - before


async def per_mode(fn: Callable[[str], Awaitable[dict]]) -> dict[str, dict]:
    """Each of MODES in its own try (an error stays in its mode)."""
    out: dict[str, dict] = {}
    for mode in MODES:
        try:
            out[mode] = {**await fn(mode), "error": None}
        except Exception as exc:
            out[mode] = {"error": _err(exc)}
    return out


# -- config, bandwidth, model --------------------------------------------------------

def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def triton_cache_entries() -> int | None:
    d = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return sum(1 for _ in d.iterdir()) if d.is_dir() else 0


def section_config(b: Bench) -> dict:
    dev: dict[str, Any] = {"type": b.device, "cpus": os.cpu_count()}
    if b.cuda:
        p = torch.cuda.get_device_properties(0)
        dev.update(name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                   sms=p.multi_processor_count, cuda=torch.version.cuda)
    else:
        dev.update(name=platform.processor() or platform.machine())
    out = {
        "device": dev, "python": platform.python_version(), "torch": torch.__version__,
        "triton": _version("triton"), "transformers": _version("transformers"),
        "model_shape": b.shape, "dtype": b.dtype, "weights": weight_bytes(b.shape, b.dtype),
        "kv_bytes_per_token": kv_bytes_per_token(b.shape, b.dtype), "quick": b.args.quick,
        "workload": asdict(b.counts), "engine": {"max_num_batched_tokens": b.counts.max_batched_tokens,
                                                 "kv_cache_memory_mib": b.counts.kv_mib, "block_size": 16,
                                                 "fused_kernels": FUSED[b.args.fused_kernels],
                                                 "split_decode": FUSED[b.args.split_decode]},
        "cuda_graphs_module_present": importlib.util.find_spec("kvstrata.worker.cuda_graphs") is not None,
        "triton_cache_entries_at_start": b.triton_cache_entries,
        "command": shlex.join([sys.executable, *sys.argv]),
        "time_budget_s": b.args.time_budget_s, "error": None,
    }
    if b.shape is TINY:
        out["note"] = "tiny CPU shape; GPU figures need CUDA" if not b.cuda else "tiny shape on CUDA (smoke run)"
    return out


def section_copy_bandwidth(b: Bench) -> dict:
    """A 1 GiB device-to-device copy (read + written bytes) and a read-only
    sum over the same bytes, timed with CUDA events; host clock on a CPU."""
    n, iters = b.counts.copy_bytes, b.counts.copy_iters
    dev = torch.device(b.device)
    src = torch.ones(n // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)

    def timed_s(fn: Callable[[], Any]) -> float:
        fn()
        b.sync()
        if b.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return time.perf_counter() - t0

    copy_s = timed_s(lambda: dst.copy_(src))
    read_s = timed_s(lambda: src.sum())
    del src, dst
    b.free()
    copy_gb_s = 2 * n * iters / copy_s / 1e9
    read_gb_s = n * iters / read_s / 1e9
    w = weight_bytes(b.shape, b.dtype)["decode_step_bytes"]
    return {"buffer_bytes": n, "iterations": iters, "copy_gb_s": round(copy_gb_s, 1),
            "copy_counts": "bytes read + bytes written", "read_gb_s": round(read_gb_s, 1),
            "weight_bytes_per_decode_step": w,
            "weight_read_limit_tok_s": round(read_gb_s * 1e9 / w, 1),
            "weight_read_limit_tok_s_from_copy": round(copy_gb_s * 1e9 / w, 1),
            "limit_basis": "read_gb_s (a sum over the buffer) / weight bytes one single-stream decode step reads",
            "timer": "cuda events" if b.cuda else "host clock", "error": None}


def section_model(b: Bench, directory: str) -> dict:
    """transformers' LlamaForCausalLM from a config, seeded, built on the device
    (1.1B parameters initialise in seconds there, minutes on a CPU), cast to the
    dtype and saved as safetensors; kept for the transformers section."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**b.shape, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(b.args.seed)
    t0 = time.perf_counter()
    built_on = b.device
    try:
        with torch.device(b.device):
            model = LlamaForCausalLM(cfg)
    except Exception as exc:  # a transformers that will not build under a device context: CPU, then move
        print(f"bench_gpu: building on {b.device} failed ({exc}); building on the CPU", file=sys.stderr)
        built_on = "cpu"
        model = LlamaForCausalLM(cfg)
    model = model.to(device=b.device, dtype=getattr(torch, b.dtype)).eval()
    b.sync()
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.save_pretrained(directory)
    save_s = time.perf_counter() - t0
    files = sorted(p.name for p in Path(directory).iterdir())
    if "config.json" not in files or not any(f.endswith(".safetensors") for f in files):
        raise RuntimeError(f"save_pretrained wrote {files}: the engine needs config.json + safetensors")
    b.model_dir, b.hf_model = directory, model
    return {"path": directory, "files": files, "params": sum(p.numel() for p in model.parameters()),
            "built_on": built_on, "build_s": round(build_s, 2), "save_s": round(save_s, 2),
            "tokenizer": "none in the directory: the engine's byte-level one; prompts are token ids",
            "error": None}


# -- engine sections -------------------------------------------------------------------

async def section_first_long_prompt(b: Bench) -> dict:
    """A fresh engine (the engine's default cuda_graphs): its start time, then
    distinct long prompts one at a time. The first one's TTFT well above the
    next ones' means something compiled or was set up on the request path."""
    c = b.counts
    before = b.engines_started
    t0 = time.perf_counter()
    engine = await start_engine(b, engine_config(b, graphs=None, max_num_seqs=8, kv_mib=c.small_kv_mib))
    start_s = time.perf_counter() - t0
    try:
        ttfts = [(await timed(engine, p, greedy(1))).ttft
                 for p in rand_prompts(3072, c.long_prompts, c.long_prompt, b.shape["vocab_size"])]
    finally:
        await close_engine(b, engine)
    nxt = statistics.median(ttfts[1:])
    return {"prompt_tokens": c.long_prompt, "engine_start_s": round(start_s, 2), "first_ttft_s": _r(ttfts[0]),
            "next_ttft_s": [_r(x) for x in ttfts[1:]], "next_ttft_p50_s": _r(nxt),
            "first_over_next": _ratio(ttfts[0], nxt), "engines_started_before_in_process": before,
            "cuda_graphs": "engine default (None)", "error": None}


async def section_decode_single_stream(b: Bench) -> dict:
    c = b.counts
    prompts = rand_prompts(512, c.single_runs, c.prompt_len, b.shape["vocab_size"])

    async def one_mode(mode: str) -> dict:
        engine = await b.engines.get(mode)
        b.sync()
        replays = graph_replays(engine)
        runs = [await timed(engine, p, greedy(c.new_tokens)) for p in prompts]
        rates = [(len(t.tokens) - 1) / (t.last - t.first) for t in runs if len(t.tokens) > 1 and t.last > t.first]
        if not rates:
            raise RuntimeError(f"no decode timing: tokens per run {[len(t.tokens) for t in runs]}")
        limit = (b.report.get("copy_bandwidth") or {}).get("weight_read_limit_tok_s")
        tok_s = statistics.median(rates)
        return {"decode_tok_s": round(tok_s, 1), "decode_tok_s_runs": [round(x, 1) for x in rates],
                "ttft_s": _r(statistics.median(t.ttft for t in runs)), "tokens": len(runs[0].tokens),
                "fraction_of_weight_read_limit": _r(tok_s / limit, 3) if limit else None,
                "graph_replays": _delta(graph_replays(engine), replays), "graphs": graph_info(engine),
                "engine_start_s": b.engines.start_s.get(mode)}

    out = await per_mode(one_mode)
    return {"workload": {"prompt_tokens": c.prompt_len, "new_tokens": c.new_tokens, "runs": c.single_runs},
            **out, "graphs_speedup": _ratio(out["graphs_on"].get("decode_tok_s"),
                                            out["graphs_off"].get("decode_tok_s")),
            "pipelined_speedup": _ratio(out["pipelined"].get("decode_tok_s"), out["graphs_on"].get("decode_tok_s")),
            "error": None}


async def section_batch(b: Bench, n: int) -> dict:
    """``n`` prompts submitted at once. Output tok/s counts every generated token
    over the wall time from submission to the last token (prefill included);
    steady_decode_tok_s only the tokens after every request had its first one."""
    c = b.counts
    prompts = batch_prompts(b, n)

    async def one_mode(mode: str) -> dict:
        engine = await b.engines.get(mode)
        await warm(engine, b, n)
        s0, replays = await engine.stats(), graph_replays(engine)
        b.sync()
        t0 = time.perf_counter()
        res = await asyncio.gather(*(timed(engine, p, greedy(c.new_tokens)) for p in prompts))
        wall = time.perf_counter() - t0
        s1 = await engine.stats()
        if n == c.batch_sizes[0]:
            b.ours_batch_tokens[mode] = [t.tokens for t in res]
        total = sum(len(t.tokens) for t in res)
        all_started = max(t.first or t.end for t in res)
        last = max(t.last or t.end for t in res)
        steady = sum(k for t in res for (at, k) in t.arrivals if at > all_started)
        ttfts = [t.ttft for t in res]
        return {"output_tokens": total, "wall_s": round(wall, 3), "output_tok_s": round(total / wall, 1),
                "ttft_p50_s": _r(statistics.median(ttfts)), "ttft_max_s": _r(max(ttfts)),
                "steady_decode_tok_s": round(steady / (last - all_started), 1) if last > all_started else None,
                "preemptions": s1.num_preemptions - s0.num_preemptions,
                "graph_replays": _delta(graph_replays(engine), replays),
                "engine_start_s": b.engines.start_s.get(mode)}

    out = await per_mode(one_mode)
    return {"workload": {"requests": n, "prompt_tokens": c.prompt_len, "new_tokens": c.new_tokens,
                         "submitted": "all at once"},
            **out, "graphs_speedup": _ratio(out["graphs_on"].get("output_tok_s"),
                                            out["graphs_off"].get("output_tok_s")),
            "pipelined_speedup": _ratio(out["pipelined"].get("output_tok_s"), out["graphs_on"].get("output_tok_s")),
            "error": None}


async def section_shared_prefix(b: Bench) -> dict:
    """Requests sharing a long prefix, sent one after another after a warm-up
    request of the same shape (other tokens: it warms the engine, not the cache)."""
    c = b.counts
    v = b.shape["vocab_size"]
    (prefix,) = rand_prompts(2048, 1, c.prefix_len, v)
    prompts = [prefix + u for u in rand_prompts(64, c.prefix_requests, c.unique_len, v)]
    (warmup,) = rand_prompts(99, 1, c.prefix_len + c.unique_len, v)
    out: dict[str, Any] = {"workload": {"requests": c.prefix_requests, "shared_prefix_tokens": c.prefix_len,
                                        "unique_tokens": c.unique_len, "new_tokens": 1, "sent": "one at a time"}}
    for name, caching in (("caching_on", True), ("caching_off", False)):
        engine = None
        try:
            engine = await start_engine(b, engine_config(b, graphs=None, caching=caching, max_num_seqs=8,
                                                         kv_mib=c.small_kv_mib))
            await timed(engine, warmup, greedy(1))
            runs = [await timed(engine, p, greedy(1)) for p in prompts]
            ttfts = [t.ttft for t in runs]
            out[name] = {"ttft_p50_s": _r(statistics.median(ttfts)), "ttft_p90_s": _r(_pct(ttfts, 90)),
                         "ttft_mean_s": _r(statistics.mean(ttfts)),
                         "cached_tokens_p50": statistics.median(t.cached for t in runs), "error": None}
        except Exception as exc:
            out[name] = {"error": _err(exc)}
        finally:
            await close_engine(b, engine)
    out["ttft_p50_off_over_on"] = _ratio(out["caching_off"].get("ttft_p50_s"), out["caching_on"].get("ttft_p50_s"))
    return {**out, "error": None}


# -- profile ---------------------------------------------------------------------------

STEP_MARK = "bench_decode_step"
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel")
GRAPH_LAUNCH_CALLS = ("cudaGraphLaunch", "cuGraphLaunch")
SYNC_CALLS = frozenset(("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                        "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH",
                        "cuMemcpyHtoD", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2"))


class StepProbe:
    """Owns: the profiler of one window of steps and what it saw.

    Stands in for ``core.execute`` (``core.launch`` for pipelined steps: the
    window then also holds the collects between its launches; an instance
    attribute over the method, removed by ``remove``): torch.profiler records the CPU ops of the thread
    that starts it, so it starts and stops in the step thread, at the first
    decode-only step of all ``n`` requests once armed, after ``steps`` steps,
    each inside a ``bench_decode_step`` mark, with a CUDA synchronize before
    the start and before the stop (the window holds exactly its steps' work)."""

    def __init__(self, core: Any, n: int, steps: int, activities: list, cuda: bool, *,
                 pipelined: bool = False) -> None:
        self._method = "launch" if pipelined else "execute"
        self._core, self._execute = core, getattr(core, self._method)
        self._n, self._steps, self._activities, self._cuda = n, steps, activities, cuda
        self._loop = asyncio.get_running_loop()
        self.armed = False
        self.finished = False
        self.prof: Any = None
        self.step_tokens: list[int] = []
        self.error: str | None = None
        self.done = asyncio.Event()
        setattr(core, self._method, self)

    def remove(self) -> None:
        self._core.__dict__.pop(self._method, None)

    def __call__(self, so: Any) -> Any:
        if self.prof is None and self.armed and not self.finished and self._decode_only(so):
            try:
                self._sync()
                self.prof = torch.profiler.profile(activities=self._activities)
                self.prof.start()
            except Exception as exc:
                self.prof = None
                self._finish(f"profiler start: {type(exc).__name__}: {exc}")
        if self.prof is None or self.finished:
            return self._execute(so)
        try:
            with torch.profiler.record_function(STEP_MARK):
                return self._execute(so)
        finally:
            self.step_tokens.append(so.total_num_scheduled_tokens)
            if len(self.step_tokens) >= self._steps:
                try:
                    self._sync()
                    self.prof.stop()
                    self._finish(None)
                except Exception as exc:
                    self._finish(f"profiler stop: {type(exc).__name__}: {exc}")

    def _decode_only(self, so: Any) -> bool:
        return (len(so.num_scheduled_tokens) == self._n and so.total_num_scheduled_tokens == self._n
                and not so.scheduled_new_reqs)

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    def _finish(self, error: str | None) -> None:
        self.error, self.finished = error, True
        self._loop.call_soon_threadsafe(self.done.set)


def _union_us(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    total, end = 0.0, lo
    for s, e in sorted(intervals):
        s, e = max(s, end), min(e, hi)
        if e > s:
            total += e - s
            end = e
    return total


def summarize_trace(events: list[dict], cuda: bool) -> dict:
    """Per-step figures from a chrome trace (torch.profiler's export) of the
    probe's window: device events (kernels, copies) all belong to its steps;
    host runtime/driver calls are counted between the first mark's start and
    the last mark's end (the probe's closing synchronize is after it)."""
    xs = [{**e, "cat": str(e.get("cat", "")).lower()} for e in events if e.get("ph") == "X"]
    marks = [e for e in xs if e["cat"] == "user_annotation" and e.get("name") == STEP_MARK]
    if not marks:
        raise RuntimeError(f"no {STEP_MARK} marks in the trace ({len(xs)} events)")
    n = len(marks)
    w0 = min(float(e["ts"]) for e in marks)
    w1 = max(float(e["ts"]) + float(e.get("dur", 0)) for e in marks)
    inside = [e for e in xs if w0 <= float(e["ts"]) <= w1]
    out: dict[str, Any] = {"steps": n, "step_ms_profiled": round((w1 - w0) / n / 1e3, 3),
                           "cpu_ops_per_step": round(sum(e["cat"] == "cpu_op" for e in inside) / n, 1)}
    if not cuda:
        return {**out, "kernels_per_step": None, "gpu_busy_fraction": None,
                "note": "CPU: no CUDA kernels, copies or syncs to count"}
    calls: dict[str, int] = {}
    for e in inside:
        if e["cat"] in ("cuda_runtime", "cuda_driver"):
            calls[e["name"]] = calls.get(e["name"], 0) + 1
    kernels = [e for e in xs if e["cat"] == "kernel"]
    copies = [e for e in xs if e["cat"] == "gpu_memcpy"]
    # CUPTI's synchronization records (newer kineto): device-side view of the same waits
    waits = [e for e in inside if e["cat"] == "cuda_sync"] if any(e["cat"] == "cuda_sync" for e in xs) else None
    htod = [e for e in copies if "HtoD" in e["name"]]
    dtoh = [e for e in copies if "DtoH" in e["name"]]
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in kernels]
    end = max([w1, *(s[1] for s in spans)])
    graphed = None
    if any("graph id" in (e.get("args") or {}) for e in kernels):
        graphed = sum(bool((e.get("args") or {}).get("graph id")) for e in kernels)
    syncs = {k: v for k, v in calls.items() if k in SYNC_CALLS}
    per = lambda x: None if x is None else round(x / n, 2)  # noqa: E731
    graph_launches = sum(v for k, v in calls.items() if k.startswith(GRAPH_LAUNCH_CALLS))
    if graph_launches and len(kernels) < 10 * graph_launches:
        out["note"] = ("graph launches but few kernels in the trace: CUPTI may not have traced the graphs' "
                       "kernels (kernel counts and the busy fraction are then low)")
    return {
        **out,
        "kernels_per_step": per(len(kernels)),
        "kernels_in_graphs_per_step": per(graphed),
        "host_kernel_launches_per_step": per(sum(v for k, v in calls.items() if k.startswith(LAUNCH_CALLS))),
        "graph_launches_per_step": per(graph_launches),
        "gpu_busy_fraction": round(_union_us(spans, w0, end) / (end - w0), 3) if end > w0 else None,
        "memcpy_htod_per_step": per(len(htod)),
        "memcpy_htod_pageable": sum("Pageable" in e["name"] for e in htod),
        "memcpy_dtoh_per_step": per(len(dtoh)),
        "memcpy_dtoh_pageable": sum("Pageable" in e["name"] for e in dtoh),
        "memcpy_kinds": sorted({e["name"] for e in copies}),
        "host_syncs_per_step": per(sum(syncs.values())),
        "cuda_sync_records_per_step": per(None if waits is None else len(waits)),
        "host_sync_calls": syncs,
        "runtime_calls_per_step": {k: per(v) for k, v in sorted(calls.items(), key=lambda kv: -kv[1])[:12]},
    }


async def section_profile(b: Bench) -> dict:
    c = b.counts
    n, steps = c.profile_requests, c.profile_steps
    prompts = rand_prompts(4096, n, c.prompt_len, b.shape["vocab_size"])
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if b.cuda else [])
    with torch.profiler.profile(activities=acts):  # the profiler's one-time set-up, in the main thread
        torch.ones(8, device=b.device).sum()
    b.sync()

    async def one_mode(mode: str) -> dict:
        engine = await b.engines.get(mode)
        await warm(engine, b, n)
        probe = StepProbe(engine.core, n, steps, acts, b.cuda, pipelined=engine.pipelined)
        started: set[int] = set()

        def arm_when_all_decode(i: int) -> Callable[[int], None]:
            def on_token(count: int) -> None:
                if count >= 2:
                    started.add(i)
                    probe.armed = len(started) == n
            return on_token

        tasks = [asyncio.create_task(timed(engine, p, greedy(steps + 16), arm_when_all_decode(i)))
                 for i, p in enumerate(prompts)]
        try:
            await asyncio.wait_for(probe.done.wait(), timeout=max(5.0, min(180.0, b.left_s())))
            await asyncio.gather(*tasks)
        except TimeoutError:
            raise RuntimeError(f"the probe saw {len(probe.step_tokens)} of {steps} steps "
                               f"(armed={probe.armed})") from None
        finally:
            probe.remove()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if probe.error:
            raise RuntimeError(probe.error)
        with tempfile.TemporaryDirectory(prefix="bench-gpu-trace-") as tmp:
            path = Path(tmp) / "trace.json"
            probe.prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text())["traceEvents"]
        return {**summarize_trace(events, b.cuda),
                "decode_only_steps": sum(t == n for t in probe.step_tokens), "trace_events": len(events)}

    out = await per_mode(one_mode)
    unprofiled_busy(out, b.report.get("batch_64x512_128"), n)
    return {"workload": {"requests": n, "prompt_tokens": c.prompt_len, "profiled_steps": steps},
            **out, "note": "figures under the profiler (its overhead lowers the busy fraction); "
                           "gpu_busy_fraction_unprofiled_est: the profiled GPU time per step over the "
                           "batch section's steady decode step time (same requests, no profiler)", "error": None}


def unprofiled_busy(profiled: dict, batch: dict | None, requests: int) -> None:
    """Per mode, the GPU's busy share of a decode step without the profiler:
    its kernels' time per step (busy fraction x step time, both profiled)
    over the step time the batch section measured for the same number of
    requests (requests / steady decode tok/s). The profiler slows the host,
    not the kernels, so this is the figure a served batch sees."""
    if not batch or batch.get("workload", {}).get("requests") != requests:
        return
    for mode, p in profiled.items():
        steady = (batch.get(mode) or {}).get("steady_decode_tok_s")
        if isinstance(p, dict) and p.get("gpu_busy_fraction") and p.get("step_ms_profiled") and steady:
            gpu_ms = p["gpu_busy_fraction"] * p["step_ms_profiled"]
            p["gpu_ms_per_step"] = round(gpu_ms, 3)
            p["gpu_busy_fraction_unprofiled_est"] = round(min(1.0, gpu_ms / (requests / steady * 1e3)), 3)


async def section_batch_served(b: Bench) -> dict:
    """The pipelined 64-request batch with the engine in a subprocess
    (``kvstrata.ipc``, the ``serve`` default): the engine's process does no
    detokenizing and wakes no consumer per token."""
    from kvstrata.ipc.mp_client import MPEngineClient

    c = b.counts
    n = c.batch_sizes[0]
    prompts = batch_prompts(b, n)
    t0 = time.perf_counter()
    engine = await MPEngineClient.start(engine_config(b, graphs=graphs_setting(b, "pipelined"), pipelined=True))
    b.engines_started += 1
    start_s = time.perf_counter() - t0
    try:
        await warm(engine, b, n)
        b.sync()
        t0 = time.perf_counter()
        res = await asyncio.gather(*(timed(engine, p, greedy(c.new_tokens)) for p in prompts))
        wall = time.perf_counter() - t0
    finally:
        await engine.aclose()
        b.free()
    total = sum(len(t.tokens) for t in res)
    all_started = max(t.first or t.end for t in res)
    last = max(t.last or t.end for t in res)
    steady_tokens = sum(k for t in res for (at, k) in t.arrivals if at > all_started)
    steady = round(steady_tokens / (last - all_started), 1) if last > all_started else None
    same = b.ours_batch_tokens.get("pipelined")
    out: dict[str, Any] = {
        "workload": {"requests": n, "prompt_tokens": c.prompt_len, "new_tokens": c.new_tokens,
                     "engine": "subprocess over ZMQ (ipc)"},
        "output_tok_s": round(total / wall, 1), "wall_s": round(wall, 3), "steady_decode_tok_s": steady,
        "ttft_p50_s": _r(statistics.median(t.ttft for t in res)), "engine_start_s": round(start_s, 1),
        "tokens_equal_in_process": None if same is None else [t.tokens for t in res] == same,
    }
    in_process = (b.report.get("batch_64x512_128") or {}).get("pipelined") or {}
    out["steady_over_in_process"] = _ratio(steady, in_process.get("steady_decode_tok_s"))
    gpu_ms = ((b.report.get("profile_decode_step") or {}).get("pipelined") or {}).get("gpu_ms_per_step")
    if gpu_ms and steady and c.profile_requests == n:
        out["gpu_ms_per_step"] = gpu_ms
        out["gpu_busy_fraction_unprofiled_est"] = round(min(1.0, gpu_ms / (n / steady * 1e3)), 3)
    return {**out, "error": None}


# -- transformers ---------------------------------------------------------------------

def _hf_generate_batch(b: Bench, model: Any, prompts: list[list[int]], new: int) -> dict:
    """transformers' continuous batching; without --quick a small call first
    (kernels, its attention switch). A call's wall time includes seconds of per-call
    manager set-up and teardown, so the span from the requests' creation to
    the last one finishing is taken too when the outputs carry it (what our
    batch sections time: submission to last token)."""
    from transformers import GenerationConfig

    def gen(n: int) -> Any:
        return GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)

    if not b.args.quick:  # its set-up (and graph capture) is outside generation_s anyway
        model.generate_batch(inputs=[prompts[0][:16]], generation_config=gen(2))
    b.sync()
    t0 = time.perf_counter()
    res = model.generate_batch(inputs=prompts, generation_config=gen(new))
    b.sync()
    wall = time.perf_counter() - t0
    keys = list(res)
    with contextlib.suppress(ValueError):
        keys.sort(key=lambda k: int(str(k).split("_")[-1]))
    errors = [getattr(res[k], "error", None) for k in keys if getattr(res[k], "error", None)]
    if len(keys) != len(prompts) or errors:
        raise RuntimeError(f"generate_batch returned {len(keys)} of {len(prompts)} results; errors: {errors[:3]}")
    seqs = [list(res[k].generated_tokens) for k in keys]
    # created_time (added to the manager) and lifespan[1] (finished) are perf_counter() stamps
    created = [getattr(res[k], "created_time", None) for k in keys]
    ends = [(getattr(res[k], "lifespan", None) or (None, None))[1] for k in keys]
    span = None
    if all(isinstance(x, float) and t0 <= x for x in created + ends):
        span = max(ends) - min(created)
    return {"api": "generate_batch", "wall": wall, "seqs": seqs, "span": span if span and span <= wall else None}


def _hf_generate(b: Bench, model: Any, prompts: list[list[int]], new: int) -> dict:
    """Batched ``generate`` (the prompts are of one length: no padding), exactly ``new`` tokens each."""
    ids = torch.tensor(prompts, device=b.device)
    kw = dict(do_sample=False, pad_token_id=0)
    model.generate(ids[:1, :16], attention_mask=torch.ones_like(ids[:1, :16]), max_new_tokens=2, **kw)
    b.sync()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, **kw)
    b.sync()
    return {"api": "generate", "wall": time.perf_counter() - t0, "seqs": out[:, ids.shape[1]:].tolist(),
            "span": None}


def section_transformers(b: Bench) -> dict:
    c = b.counts
    n = c.batch_sizes[0]
    prompts = batch_prompts(b, n)
    model = b.hf_model
    out: dict[str, Any] = {"workload": {"requests": n, "prompt_tokens": c.prompt_len, "new_tokens": c.new_tokens},
                           "dtype": b.dtype}
    if not b.cuda:
        out["note"] = ("generate_batch skipped on a CPU: its set-up sizes static tensors from free memory "
                       "(~17 s to fill them on a 2-core host); batched generate instead")
    with torch.no_grad():
        run_ = None
        if hasattr(model, "generate_batch") and b.cuda:
            try:
                run_ = _hf_generate_batch(b, model, prompts, c.new_tokens)
            except Exception as exc:
                out["generate_batch_error"] = _err(exc)
        if run_ is None:
            run_ = _hf_generate(b, model, prompts, c.new_tokens)
    seqs = run_["seqs"]
    total = sum(len(s) for s in seqs)
    span_tok_s = total / run_["span"] if run_["span"] else None
    out.update(api=run_["api"], output_tokens=total, wall_s=round(run_["wall"], 3),
               output_tok_s_wall=round(total / run_["wall"], 1), generation_s=_r(run_["span"], 3),
               output_tok_s=round(span_tok_s or total / run_["wall"], 1),
               output_tok_s_basis="generation_s (creation to last finish)" if span_tok_s else "wall_s")
    ours = b.report.get("batch_64x512_128") or {}
    mine = {m: (ours.get(m) or {}).get("output_tok_s") for m in MODES}
    out["ours_over_theirs"] = {m: _ratio(mine[m], out["output_tok_s"]) for m in MODES}
    out["ours_over_theirs_wall"] = {m: _ratio(mine[m], out["output_tok_s_wall"]) for m in MODES}
    mine = b.ours_batch_tokens.get("graphs_off")
    if mine and len(mine) == len(seqs):
        out["same_as_ours_graphs_off"] = {"sequences": sum(a == t for a, t in zip(mine, seqs)),
                                          "first_tokens": sum(a[:1] == t[:1] for a, t in zip(mine, seqs)),
                                          "of": len(seqs), "note": "same weights and dtype, other kernels: "
                                                                   "greedy paths may part at near ties"}
    return {**out, "error": None}


# -- tiers -------------------------------------------------------------------------------

def load_tool(name: str) -> Any:
    """Another tool of this directory, as a module of its own (tools/ is no package)."""
    path = Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_bench_gpu_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # as an import would (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


async def section_tiers(b: Bench) -> dict:
    """tools/bench_tiers.py's own run (modes none, recompute-saving, tiers,
    tiers-staged) on this checkpoint and device. Its CPU tier is sized to
    hold the whole working set, so a later turn's history is a CPU-tier hit
    rather than a recompute."""
    t = b.counts.tiers
    final = t["first_turn_tokens"] + (t["turns"] - 1) * (t["user_tokens"] + t["output_tokens"]) + t["output_tokens"]
    ws_bytes = final * t["conversations"] * kv_bytes_per_token(b.shape, b.dtype)
    argv = ["--model", str(b.model_dir), "--dtype", b.dtype, "--device", b.device,
            *(x for k, v in t.items() for x in (f"--{k.replace('_', '-')}", str(v))),
            "--working-set-ratio", str(b.counts.tiers_working_set_ratio),
            # the connector's default chunk (bench_tiers' own 64 keeps CPU runs small): a 3k-token
            # history is 12 chunks, not 48, each a host copy per layer on the CUDA load path
            "--chunk-size", str(OffloadOptions().chunk_size if b.cuda else 64),
            "--cpu-mib", str(max(48, int(ws_bytes * 1.5) >> 20)), "--disk-mib", str(max(64, int(ws_bytes * 2) >> 20)),
            "--max-batched-tokens", str(b.counts.max_batched_tokens),
            "--modes", "none,recompute-saving,tiers,tiers-staged"]
    b.engines_started += 4
    rep = await load_tool("bench_tiers").main(argv)
    b.free()
    m = rep["modes"]
    none, saving, tiers, staged = (m[k] for k in ("none", "recompute-saving", "tiers", "tiers-staged"))
    later = {name: mode["ttft_p50_later_turns_s"] for name, mode in
             (("recompute", none), ("recompute_saving", saving), ("tiers", tiers), ("tiers_staged", staged))}
    return {"workload": {**t, "working_set_over_pool": rep["working_set_over_pool"]},
            "ttft_p50_later_turns_s": later,
            "later_turns_recompute_over_tiers": _ratio(later["recompute"], later["tiers"]),
            "later_turns_recompute_saving_over_tiers": _ratio(later["recompute_saving"], later["tiers"]),
            "later_turns_recompute_over_tiers_staged": _ratio(later["recompute"], later["tiers_staged"]),
            "later_turns_recompute_saving_over_tiers_staged": _ratio(later["recompute_saving"],
                                                                     later["tiers_staged"]),
            "tier_hit_tokens": tiers["tier_hit_tokens"], "device_hit_tokens": tiers["device_hit_tokens"],
            "tier_hit_tokens_staged": staged["tier_hit_tokens"],
            "preemptions": {"recompute": none["preemptions"], "recompute_saving": saving["preemptions"],
                            "tiers": tiers["preemptions"], "tiers_staged": staged["preemptions"]},
            "modes": "recompute: no prefix caching, no tiers; recompute_saving: no prefix caching, the tiers' "
                     "connector saving, never loading (role producer: the same save traffic, the like-for-like "
                     "baseline); tiers: device cache + CPU (L1) + disk, the connector's default transfers "
                     "(batched per layer); tiers_staged: staged_layer_transfers on",
            "bench_tiers_argv": argv, "bench_tiers": rep, "error": None}


# -- the run ------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats and requests (< 4 min on an H100)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated; config always runs")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--shape", default="auto", choices=["auto", "tinyllama", "tiny"],
                   help="auto: TinyLlama-1.1B's on CUDA, tiny on a CPU")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="sections starting after it are skipped, a running one is cut (default 210 quick, 480)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=None, help="model.num_threads (default 1 on a CPU)")
    p.add_argument("--fused-kernels", default="default", choices=sorted(FUSED),
                   help="model.fused_kernels for every engine (default: the engine's own default)")
    p.add_argument("--split-decode", default="default", choices=sorted(FUSED),
                   help="model.split_decode for every engine (default: the engine's own default)")
    args = p.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.time_budget_s is None:
        args.time_budget_s = 210.0 if args.quick else 480.0
    return args


def make_bench(args: argparse.Namespace) -> Bench:
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    shape = TINYLLAMA if args.shape == "tinyllama" or (args.shape == "auto" and device == "cuda") else TINY
    wanted = {"config", *args.sections.split(",")}
    if wanted & NEEDS_MODEL:
        wanted.add("model")
    b = Bench(args=args, device=device, shape=shape, dtype="bfloat16" if device == "cuda" else "float32",
              counts=make_counts(device, args.quick), deadline=time.monotonic() + args.time_budget_s,
              report={name: None for name in SECTIONS if name in wanted})
    b.triton_cache_entries = triton_cache_entries()
    b.engines = Engines(b)
    return b


# Seconds a section needs left to start, beyond the default 5: a synchronous
# section cannot be cut by the budget, and transformers' generate_batch takes
# tens of seconds to set up (a run past the caller's own limit loses its JSON).
MIN_LEFT_S = {"transformers_generate": 45}


async def run_section(b: Bench, name: str, fn: Callable[[], Any]) -> None:
    """One section in its own try (and, async, under the time left); its result
    goes into the report and, at once, to stderr as one JSON line."""
    t0 = time.perf_counter()
    if b.left_s() < MIN_LEFT_S.get(name, 5):
        result: dict = {"error": "skipped: time budget spent"}
    elif name in NEEDS_MODEL and b.model_dir is None:
        result = {"error": f"no model: {(b.report.get('model') or {}).get('error')}"}
    else:
        try:
            result = fn()
            if inspect.isawaitable(result):
                async with asyncio.timeout(b.left_s()):
                    result = await result
        except TimeoutError:
            result = {"error": f"cut: the time budget ran out after {time.perf_counter() - t0:.0f} s in it"}
        except Exception as exc:
            result = {"error": _err(exc)}
    result["section_s"] = round(time.perf_counter() - t0, 2)
    b.free()  # the section's engines are unreferenced only now
    b.report[name] = result
    print("bench_gpu " + json.dumps({name: result}), file=sys.stderr, flush=True)


async def main_async(argv: list[str] | None = None) -> dict:
    b = make_bench(parse_args(argv))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-gpu-model-") as tmp:
        sections: dict[str, Callable[[], Any]] = {
            "config": lambda: section_config(b),
            "copy_bandwidth": lambda: section_copy_bandwidth(b),
            "model": lambda: section_model(b, tmp),
            "first_long_prompt_s": lambda: section_first_long_prompt(b),
            "decode_single_stream": lambda: section_decode_single_stream(b),
            "batch_64x512_128": lambda: section_batch(b, b.counts.batch_sizes[0]),
            "batch_256x512_128": lambda: section_batch(b, b.counts.batch_sizes[1]),
            "profile_decode_step": lambda: section_profile(b),
            "batch_64_served": lambda: section_batch_served(b),
            "transformers_generate": lambda: section_transformers(b),
            "shared_prefix_ttft": lambda: section_shared_prefix(b),
            "tiers": lambda: section_tiers(b),
        }
        hf_at = ORDER.index("transformers_generate")
        try:
            for i, name in enumerate(ORDER):
                if i >= hf_at:  # no later section uses the shared engines; transformers sizes its cache
                    await b.engines.aclose()  # from the free memory
                if i > hf_at and b.hf_model is not None:
                    b.hf_model = None
                    b.free()
                if name in b.report:
                    await run_section(b, name, sections[name])
        finally:
            await b.engines.aclose()
            b.hf_model = None
            b.free()
    b.report["total_s"] = round(time.perf_counter() - t0, 1)
    b.report["engines_started"] = b.engines_started
    return b.report


def main(argv: list[str] | None = None) -> dict:
    # Nothing is downloaded here: transformers' continuous batching looks for flash-attention
    # kernels on the Hub when the `kernels` package is installed; offline, it asks nothing.
    # (Set before huggingface_hub is first imported: it reads this once.)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = run(main_async(argv))
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    configure_logging("WARNING", json=False)  # logs on stderr; stdout is the JSON report
    main(sys.argv[1:])
