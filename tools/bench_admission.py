"""Benchmark: admission order, FCFS vs cache-aware (``scheduler.policy``).
Prints JSON.

    python tools/bench_admission.py [--families 12 --requests 600 --num-blocks 512]

The engine core is the real one (scheduler, KV cache manager with prefix
caching, eviction) over the null executor (no model: tokens at no cost), so
the figures are about admission order alone: a burst of requests from
``--families`` shared-prefix families arrives interleaved at a queue longer
than ``max_num_seqs``, over a pool that holds only a few families' prefixes
at once. Reported per policy: the device prefix hit rate (prompt tokens
found cached over prompt tokens), engine steps to drain the burst, and the
worst wait past FCFS order (the largest number of later arrivals admitted
ahead of a request; 0 for FCFS by construction), next to the configured
bound.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from kvstrata.enginecore.builder import build_engine_core  # noqa: E402
from kvstrata.enginecore.request import EngineRequest  # noqa: E402
from kvstrata.types import SamplingParams  # noqa: E402


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(3, 250) for _ in range(args.prefix_len)] for _ in range(args.families)]
    return [prefixes[rng.randrange(args.families)] + [rng.randrange(3, 250) for _ in range(args.suffix_len)]
            for _ in range(args.requests)]


def run(policy: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    config = EngineConfig(executor="null", device="cpu", log_level="WARNING", model=ModelConfig(),
                          cache=CacheConfig(block_size=16, num_blocks=args.num_blocks),
                          scheduler=SchedulerConfig(policy=policy, max_num_seqs=args.max_num_seqs,
                                                    max_num_batched_tokens=args.budget,
                                                    cache_aware_max_skips=args.max_skips, async_scheduling=False))
    core = build_engine_core(config)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=p, sampling_params=params,
                                       arrival_time=float(i)))
    admitted: list[int] = []
    steps = 0
    while core.has_work():
        so = core.schedule()
        admitted += [int(d.req_id[1:]) for d in so.scheduled_new_reqs if d.req_id.startswith("r")]
        if core.should_execute(so):
            core.update(so, core.execute(so))
        steps += 1
    st = core.stats()
    # worst wait past FCFS: for each request, how many later arrivals were admitted first
    first_admission: dict[int, int] = {}
    for pos, i in enumerate(admitted):
        first_admission.setdefault(i, pos)
    order = sorted(first_admission, key=first_admission.get)
    worst = 0
    for pos, i in enumerate(order):
        later_before = sum(1 for j in order[:pos] if j > i)
        worst = max(worst, later_before)
    return {
        "policy": policy,
        "prefix_hit_rate": round(st.prefix_cache_hits / max(st.prefix_cache_queries, 1), 4),
        "steps": steps,
        "preemptions": st.num_preemptions,
        "worst_wait_past_fcfs_admissions": worst,
        "max_skips_observed": st.extra.get("scheduler.cache_aware.max_skips_observed"),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", type=int, default=12)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=160, help="pool blocks (16 tokens each)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--max-skips", type=int, default=64, help="cache-aware aging bound")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    prompts = workload(args)
    report = {"config": vars(args), "runs": [run(p, prompts, args) for p in ("fcfs", "cache-aware")]}
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(report), indent=2).decode() + "\n")
    return report


if __name__ == "__main__":
    from kvstrata.logs import configure_logging

    configure_logging("WARNING", json=False)
    main()
