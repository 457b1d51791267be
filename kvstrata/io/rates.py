"""What reading a tier costs, measured online, and an optional cap on it.

``ReadRate`` keeps, per lower tier, moving averages of what its reads
achieved: bandwidth over a batch (the bytes one ``get`` read from the tier
over the time until its last read of that tier ended, so parallel reads
count as the tier delivers them), the latency of one read, and the share of
reads that failed. ``predict(nbytes)`` turns them into the seconds a read of
``nbytes`` is expected to take; None until the tier has been measured. The
connector's cost model (``connector/offload/costs.py``) weighs that against
recomputing the same tokens.

``ReadThrottle`` caps a tier's read bandwidth (``TierSpec.read_bandwidth_bps``):
reads take turns on a link of that many bytes per second, and a read that
finished sooner is held until its turn ends. For benchmarks that need a
slower medium than the machine has, and for tiers sharing a link.
"""

from __future__ import annotations

ALPHA = 0.2  # weight of the newest sample in every moving average


def _ema(old: float | None, new: float, alpha: float = ALPHA) -> float:
    return new if old is None else old + alpha * (new - old)


class ReadRate:
    """Owns: one tier's read measurements. Loop only."""

    __slots__ = ("bandwidth_bps", "latency_s", "failure_rate", "reads", "bytes_read", "failures")

    def __init__(self) -> None:
        self.bandwidth_bps: float | None = None
        self.latency_s: float | None = None
        self.failure_rate = 0.0
        self.reads = 0
        self.bytes_read = 0
        self.failures = 0

    def observe_read(self, seconds: float, nbytes: int, ok: bool) -> None:
        """One read ended after ``seconds`` (``ok``: it delivered)."""
        self.reads += 1
        self.failure_rate = _ema(self.failure_rate if self.reads > 1 else None, 0.0 if ok else 1.0)
        if not ok:
            self.failures += 1
            return
        self.bytes_read += nbytes
        self.latency_s = _ema(self.latency_s, max(seconds, 0.0))

    def observe_batch(self, seconds: float, nbytes: int) -> None:
        """One ``get`` read ``nbytes`` from the tier, the last read ending ``seconds`` after it began."""
        if seconds > 0 and nbytes > 0:
            self.bandwidth_bps = _ema(self.bandwidth_bps, nbytes / seconds)

    def predict(self, nbytes: int) -> float | None:
        """Expected seconds to read ``nbytes`` in one batch; None: not measured yet."""
        if self.bandwidth_bps is None or self.latency_s is None:
            return None
        return max(self.latency_s, nbytes / self.bandwidth_bps)

    def as_dict(self, prefix: str) -> dict[str, float]:
        out = {f"{prefix}.reads": float(self.reads), f"{prefix}.read_failures": float(self.failures),
               f"{prefix}.read_failure_rate": self.failure_rate}
        if self.bandwidth_bps is not None:
            out[f"{prefix}.read_bandwidth_bps"] = self.bandwidth_bps
        if self.latency_s is not None:
            out[f"{prefix}.read_latency_s"] = self.latency_s
        return out


class ReadThrottle:
    """Owns: the time the capped link is busy until. Loop only."""

    __slots__ = ("bps", "_free_at")

    def __init__(self, bps: float) -> None:
        if not bps > 0:
            raise ValueError(f"read_bandwidth_bps must be > 0, got {bps!r}")
        self.bps = float(bps)
        self._free_at = 0.0

    def reserve(self, nbytes: int, now: float) -> float:
        """Take the link's next turn for ``nbytes``; returns when that turn ends."""
        start = max(now, self._free_at)
        self._free_at = start + nbytes / self.bps
        return self._free_at
