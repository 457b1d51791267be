"""Load or compute: where a request's stored prefix is split between the two.

A hit of ``n`` chunks past the device prefix can be loaded from the tiers or
recomputed, and the two can overlap (the "Cake" schedule): the model
computes the first ``k`` chunks while the store reads chunks ``k..n-1`` into
CPU memory; once both are done the read chunks are copied in and the rest
of the prompt is computed. The time until the hit is covered is::

    T(k) = max(compute(k), load(k))
    compute(k) = a step's own cost + tokens of chunks [0, k) x prefill
                 seconds per token (0 for k = 0: the front needs a step of
                 its own only when there is one)
    load(k)    = max over tiers of the predicted read time of that tier's
                 chunks in [k, n)  (tiers read in parallel; CPU memory ~ 0)

``choose_split`` returns the ``k`` that minimizes ``T`` (ties: the smaller
``k``, loading more and computing less). Both rates are moving averages
measured online: prefill seconds per token from the worker's step reports
(``TransferMetrics.s_per_token`` and ``step_s``, fitted over steps), each tier's read bandwidth and latency
from its reads (``kvstrata.io.rates.ReadRate``). Until a rate is measured
the hit is loaded (load-only is what measures a tier); a tier whose recent
reads mostly failed is not used (its chunks cost infinity).

Pure functions of their inputs, so the decision is easy to test and to
replay; the LoadPlanner applies it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

FAILING = 0.5  # a tier whose moving failure rate is above this is not read


class ChunkCost(NamedTuple):
    """One chunk of a plan: its tokens, its bytes, and its tier (None: CPU memory)."""

    tokens: int
    nbytes: int
    tier: str | None


class Split(NamedTuple):
    """``compute``: leading chunks to recompute (0: load all; n: compute all);
    ``seconds``: the predicted time until the hit is covered, ``load_s``: until
    the chunks after the front are read (None: unmeasured)."""

    compute: int
    seconds: float | None
    reason: str
    load_s: float | None = None


def choose_split(chunks: Sequence[ChunkCost], s_per_token: float | None,
                 predict: Callable[[str, int], float | None],
                 failure_rate: Callable[[str], float], step_s: float = 0.0) -> Split:
    """The split of ``chunks`` that minimizes the time to cover them
    (``step_s``: what computing the front in a step of its own adds).

    ``predict(tier, nbytes)``: seconds to read ``nbytes`` from ``tier`` in one
    batch, None if not measured; ``failure_rate(tier)``: its recent share of
    failed reads."""
    n = len(chunks)
    tiers = {c.tier for c in chunks if c.tier is not None}
    if not tiers:
        return Split(0, 0.0, "memory")  # all in CPU memory: a copy, never worth recomputing
    if any(failure_rate(t) > FAILING for t in tiers):
        failing = {t for t in tiers if failure_rate(t) > FAILING}
        first_bad = next(i for i, c in enumerate(chunks) if c.tier in failing)
        if first_bad == 0:
            return Split(n, None, "tier_failing")
        chunks = chunks[:first_bad]  # the chunks after a failing tier's first one are recomputed anyway
        tail = n - first_bad
    else:
        tail = 0
    if s_per_token is None:
        return Split(0, None, "compute_unmeasured")
    m = len(chunks)
    # Suffix sums of bytes per tier, so load(k) costs O(tiers).
    suffix: list[dict[str, int]] = [{} for _ in range(m + 1)]
    for i in range(m - 1, -1, -1):
        d = dict(suffix[i + 1])
        c = chunks[i]
        if c.tier is not None:
            d[c.tier] = d.get(c.tier, 0) + c.nbytes
        suffix[i] = d
    best: Split | None = None
    computed = 0
    for k in range(m + 1):
        load = 0.0
        for tier, nbytes in suffix[k].items():
            t = predict(tier, nbytes)
            if t is None:
                return Split(0, None, "tier_unmeasured")
            load = max(load, t)
        total = max(step_s + computed * s_per_token if k else 0.0, load)
        if best is None or total < best.seconds - 1e-12:  # type: ignore[operator]
            best = Split(k, total, "", load)
        if k < m:
            computed += chunks[k].tokens
    assert best is not None
    k = best.compute
    if tail and k == m:
        k = n  # everything up to the failing tier computed: the rest is too
    reason = "load_only" if k == 0 else "compute_only" if k >= m else "split"
    return Split(k, best.seconds, reason, best.load_s)


def forced_split(n: int, fraction: float) -> Split:
    """``fraction`` of the chunks computed first (rounded), for tests and benchmarks."""
    k = min(n, max(0, math.floor(fraction * n + 0.5)))
    return Split(k, None, "forced")
