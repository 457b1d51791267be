"""Load or compute: TTFT of a stored prefix read from a disk tier capped at
several bandwidths, loaded whole, recomputed whole, or split by the cost
model (prints JSON; never asserts).

Workload: ``--docs`` documents of ``--doc-tokens`` tokens are computed once
(stored in L1 and on disk); then each request is a document plus a fresh
question of ``--question-tokens`` tokens, sent alone, after the device prefix
cache and L1 are emptied, so its hit comes from the disk tier. The disk's
reads are capped with ``TierSpec.read_bandwidth_bps`` at each of
``--bandwidths`` MB/s (0: no cap: this machine's page cache). Three engines
per bandwidth, one per ``load_split``:

    load      read the whole hit (what the connector did before the cost model)
    compute   recompute the whole hit (as if there were no tier)
    cost      the cost model's split: compute the front while the back loads,
              from the rates it measured (the first ``--warmup`` requests,
              before anything is measured, load; they are not timed)

Reported per bandwidth and mode: TTFT p50 / max over ``--requests`` requests,
the tier's measured bandwidth, the split counters; per bandwidth, the best
fixed mode and the cost model's TTFT over it (the crossover: where compute
starts to beat load).

    python tools/bench_load_split.py [--bandwidths 10,25,50,100,200,400,0] [--requests 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import tempfile
import time

import torch

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvstrata.connector import KVTransferConfig
from kvstrata.enginecore import AsyncEngine, SamplingParams
from kvstrata.logs import configure_logging

MODES = ("load", "compute", "cost")


def engine_config(args: argparse.Namespace, mode: str, bandwidth_mb_s: float, tmp: str) -> EngineConfig:
    disk = {"type": "disk", "name": "disk", "write": "through",
            "options": {"path": f"{tmp}/disk", "capacity_bytes": args.disk_mib << 20, "use_odirect": False}}
    if bandwidth_mb_s > 0:
        disk["read_bandwidth_bps"] = bandwidth_mb_s * 1e6
    kv_transfer = KVTransferConfig(connector="offload", options={
        "chunk_size": args.chunk_size, "load_split": mode, "max_prefetch": 0,
        "store": {"cpu": {"capacity_bytes": args.cpu_mib << 20, "pin_memory": False}, "tiers": [disk]},
    })
    tokens = args.docs * (args.doc_tokens + args.question_tokens) + 4096
    return EngineConfig(model=ModelConfig(model=args.model, seed=args.seed),
                        cache=CacheConfig(block_size=args.block_size, num_blocks=tokens // args.block_size + 1),
                        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens),
                        kv_transfer=kv_transfer, log_level="WARNING")


async def ttft(engine: AsyncEngine, prompt: list[int]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    async for _ in engine.generate(prompt, params):
        return time.perf_counter() - t0
    raise RuntimeError("no output")


async def cold(engine: AsyncEngine) -> None:
    """Empty the device prefix cache and L1: the next hit comes from disk."""
    await engine.flush_kv()
    await engine.reset_prefix_cache()
    engine.core.kv_connector.store.l1.clear()


async def run(args: argparse.Namespace, mode: str, bw: float, docs: list[list[int]], rng: random.Random) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-split-") as tmp:
        engine = await AsyncEngine.start(engine_config(args, mode, bw, tmp))
        try:
            for d in docs:  # computed once: stored in L1 and on disk
                await ttft(engine, d)
            times = []
            for i in range(args.warmup + args.requests):
                doc = docs[i % len(docs)]
                q = [rng.randint(1, 255) for _ in range(args.question_tokens)]
                await cold(engine)
                t = await ttft(engine, doc + q)
                if i >= args.warmup:
                    times.append(t)
            stats = await engine.stats()
        finally:
            await engine.aclose()
    x = stats.extra
    return {
        "ttft_p50_s": round(statistics.median(times), 4),
        "ttft_max_s": round(max(times), 4),
        "disk_hit_tokens": int(x.get("connector.disk.hit_tokens", 0)),
        "measured_read_mb_s": round(x.get("store.disk.read_bandwidth_bps", 0.0) / 1e6, 1),
        "measured_prefill_tokens_per_s": round(x.get("connector.prefill_tokens_per_s", 0.0)),
        "splits": {k.split(".", 1)[1]: int(v) for k, v in x.items() if k.startswith("connector.split_")},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the seeded default model)")
    p.add_argument("--bandwidths", default="10,25,50,100,200,400,0",
                   help="disk read caps in MB/s, comma-separated (0: no cap)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--doc-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=6, help="timed requests per engine")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests first (the cost model measures)")
    p.add_argument("--chunk-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--cpu-mib", type=int, default=256)
    p.add_argument("--disk-mib", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


async def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    docs = [[rng.randint(1, 255) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
    modes = args.modes.split(",")
    report: dict = {
        "benchmark": "bench_load_split", "command": "python tools/bench_load_split.py " + " ".join(argv or []),
        "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.machine(), "doc_tokens": args.doc_tokens, "question_tokens": args.question_tokens,
        "chunk_size": args.chunk_size, "requests": args.requests, "by_bandwidth": {},
    }
    for bw in (float(b) for b in args.bandwidths.split(",")):
        row = {mode: await run(args, mode, bw, docs, random.Random(args.seed + 1)) for mode in modes}
        fixed = [m for m in ("load", "compute") if m in row]
        if fixed and "cost" in row:
            best = min(fixed, key=lambda m: row[m]["ttft_p50_s"])
            row["best_fixed"] = best
            row["cost_over_best_fixed"] = round(row["cost"]["ttft_p50_s"] / max(row[best]["ttft_p50_s"], 1e-9), 3)
        report["by_bandwidth"]["uncapped" if bw == 0 else f"{bw:g}MB/s"] = row
    return report


if __name__ == "__main__":
    configure_logging("WARNING", json=False)  # logs on stderr; stdout is the JSON report
    out = asyncio.run(main(sys.argv[1:]))
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
