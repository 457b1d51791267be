"""The load-test report: throughput, latency percentiles, and every engine
stat (``EngineStats``: prefix cache hit rate per tier, preemptions, engine
token counts, sampled KV block residency, the components' ``extra``
counters; counters as before/after deltas), what the model answered
(``transcripts``), as a JSON-able dict; optional PNG plots when matplotlib
is importable."""

from __future__ import annotations

import math

from kvstrata.types import BlockResidencyStats, EngineStats, HistogramSnapshot
from kvstrata.bench.driver import LoadResult
from kvstrata.bench.transcripts import Report, example_conversation, format_transcripts, sample_turns
from kvstrata.api_server.metrics import metric_name, tier_hit_rates

PERCENTILES = (50, 90, 99)


def percentile(sorted_vals: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_vals:
        return math.nan
    k = (len(sorted_vals) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def summarize(values_s: list[float]) -> dict[str, float | None]:
    """Milliseconds: mean and p50/p90/p99 (None when there is no sample)."""
    vals = sorted(values_s)
    if not vals:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    out: dict[str, float | None] = {"mean": round(1000 * sum(vals) / len(vals), 3)}
    for p in PERCENTILES:
        out[f"p{p}"] = round(1000 * percentile(vals, p), 3)
    return out


def build_report(result: LoadResult, before: EngineStats | None, after: EngineStats | None,
                 **context: object) -> Report:
    recs = result.records
    ok = [r for r in recs if r.error is None]
    duration = max(result.end - result.start, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    ttft = [r.first_token - r.start for r in ok if r.first_token is not None]
    e2e = [r.end - r.start for r in ok]
    tpot = [(r.end - r.first_token) / (r.output_tokens - 1)
            for r in ok if r.first_token is not None and r.output_tokens > 1]
    itl: list[float] = []
    for r in ok:
        t = r.chunk_times
        itl.extend(t[i] - t[i - 1] for i in range(1, len(t)))
    report: Report = {
        **context,
        "num_requests": len(recs),
        "num_completed": len(ok),
        "num_errors": len(recs) - len(ok),
        "errors_sample": sorted({r.error for r in recs if r.error})[:5],
        "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 3),
        "output_token_throughput": round(out_tokens / duration, 2),
        "total_token_throughput": round((out_tokens + prompt_tokens) / duration, 2),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "ttft_ms": summarize(ttft),
        "tpot_ms": summarize(tpot),
        "itl_ms": summarize(itl),
        "e2e_ms": summarize(e2e),
    }
    report.update(engine_deltas(before, after))
    report["answers"] = sample_turns(result)
    report["example_conversation"] = example_conversation(result)
    return report


def engine_deltas(before: EngineStats | None, after: EngineStats | None) -> Report:
    """Every engine stat during the run: prefix hit rate per tier,
    preemptions, engine counters, block residency, ``extra``."""
    if after is None:
        return {"prefix_cache": None, "preemptions": None, "engine": None, "kv_block_residency": None}
    t1 = tier_hit_rates(after)
    t0 = tier_hit_rates(before) if before is not None else {}
    tiers: dict[str, Report] = {}
    for tier, v in t1.items():
        b = t0.get(tier, {"hits": 0.0, "queries": 0.0})
        hits, queries = v["hits"] - b["hits"], v["queries"] - b["queries"]
        tiers[tier] = {"hit_tokens": int(hits), "query_tokens": int(queries),
                       "hit_rate": round(hits / queries, 4) if queries > 0 else 0.0}
    base = before if before is not None else EngineStats()
    return {
        "prefix_cache": tiers,
        "preemptions": after.num_preemptions - base.num_preemptions,
        "kv_usage_at_end": round(after.kv_usage, 4),
        "engine": {
            "finished": after.num_finished - base.num_finished,
            "prompt_tokens": after.num_prompt_tokens - base.num_prompt_tokens,
            "generated_tokens": after.num_generated_tokens - base.num_generated_tokens,
            "running_at_end": after.num_running,
            "waiting_at_end": after.num_waiting,
            # Gauges and counters of the components (counters: since start),
            # named as on /metrics so a server's read back the same.
            "extra_at_end": {metric_name(k)[len("kvstrata_"):]: v for k, v in sorted(after.extra.items())},
        },
        "kv_block_residency": residency_delta(base.block_residency, after.block_residency),
    }


def residency_delta(before: BlockResidencyStats | None, after: BlockResidencyStats | None) -> Report | None:
    """Sampled KV blocks evicted during the run: how many, their reuses, and
    per quantity the mean and the bucket bounds holding the median and p90
    (None when sampling is off)."""
    if after is None:
        return None
    out: Report = {
        "sample_rate": after.sample_rate,
        "samples": after.num_samples - (before.num_samples if before is not None else 0),
        "reuses": after.num_reuses - (before.num_reuses if before is not None else 0),
    }
    for field in ("lifetime_s", "idle_before_eviction_s", "reuse_gap_s"):
        out[field] = _histogram_summary(getattr(after, field), getattr(before, field) if before is not None else None)
    return out


def _histogram_summary(after: HistogramSnapshot, before: HistogramSnapshot | None) -> Report:
    counts = list(after.counts)
    total, count = after.sum, after.count
    if before is not None and before.bounds == after.bounds:
        counts = [a - b for a, b in zip(counts, before.counts)]
        total, count = total - before.sum, count - before.count
    summary: Report = {"count": count, "mean": round(total / count, 4) if count else None}
    for p in (50, 90):
        summary[f"p{p}_le"] = _bucket_bound(after.bounds, counts, count * p / 100) if count else None
    return summary


def _bucket_bound(bounds: tuple[float, ...], counts: list[int], rank: float) -> float | str:
    """The upper bound of the bucket holding the ``rank``-th observation."""
    acc = 0
    for bound, n in zip(bounds, counts):
        acc += n
        if acc >= rank:
            return bound
    return "+Inf"


def format_report(report: Report) -> str:
    """A short human-readable table (the JSON is the full report)."""
    lines = [
        f"requests        {report['num_completed']}/{report['num_requests']} ok in {report['duration_s']} s "
        f"({report['request_throughput']} req/s)",
        f"output tokens   {report['output_tokens']} ({report['output_token_throughput']} tok/s)",
        f"prompt tokens   {report['prompt_tokens']} ({report['cached_prompt_tokens']} cached)",
    ]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = report[key]
        lines.append(f"{key:<15} " + "  ".join(f"{k}={v}" for k, v in s.items()))
    tiers = report.get("prefix_cache") or {}
    for tier, v in tiers.items():
        lines.append(f"hit rate {tier:<6} {v['hit_rate']:.2%} ({v['hit_tokens']}/{v['query_tokens']} tokens)")
    if len(tiers) > 1:
        lines.append("                (device: of all prompt tokens; the tiers: of those the device cache missed)")
    lines.append(f"preemptions     {report.get('preemptions')}")
    res = report.get("kv_block_residency")
    if res and res["samples"]:
        life = res["lifetime_s"]
        lines.append(f"kv blocks       {res['samples']} sampled evictions: lifetime mean {life['mean']} s "
                     f"(p50 <= {life['p50_le']} s), {res['reuses']} reuses")
    if report["num_errors"]:
        lines.append(f"errors          {report['num_errors']}: {report['errors_sample']}")
    lines += format_transcripts(report)
    return "\n".join(lines)


def write_plots(result: LoadResult, directory: str) -> list[str]:
    """TTFT CDF and output throughput over time; [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    import os

    os.makedirs(directory, exist_ok=True)
    ok = [r for r in result.records if r.error is None and r.first_token is not None]
    ttft = sorted(1000 * (r.first_token - r.start) for r in ok)  # type: ignore[operator]
    paths = []
    fig, ax = plt.subplots()
    ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))])
    ax.set_xlabel("TTFT (ms)"), ax.set_ylabel("fraction of requests"), ax.set_title("TTFT CDF")
    paths.append(os.path.join(directory, "ttft_cdf.png"))
    fig.savefig(paths[-1]), plt.close(fig)
    # About 40 bins over the run (at least 10 ms each), so a short run still
    # draws a curve; each bin's token count is scaled to tokens per second.
    times = [(t - result.start, n) for r in result.records for t, n in zip(r.chunk_times, r.chunk_tokens)]
    span = max((t for t, _ in times), default=0.0)
    width = max(span / 40, 0.01)
    bins = [0] * (int(span / width) + 1)
    for t, n in times:
        bins[int(t / width)] += n
    fig, ax = plt.subplots()
    ax.step([i * width for i in range(len(bins))], [n / width for n in bins], where="post")
    ax.set_xlabel("time (s)"), ax.set_ylabel("output tokens/s"), ax.set_title("Output throughput")
    paths.append(os.path.join(directory, "throughput.png"))
    fig.savefig(paths[-1]), plt.close(fig)
    return paths
