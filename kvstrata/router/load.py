"""Replica load as the router sees it, and the rule that skips hot replicas."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class ReplicaLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One replica's outstanding work, as the server last knew it:
    prompt tokens waiting for prefill, and requests decoding."""

    queued_prefill_tokens: int = 0
    running_requests: int = 0

    def cost(self, decode_weight: float) -> float:
        """In prefill-token equivalents: ``decode_weight`` per running request."""
        return self.queued_prefill_tokens + decode_weight * self.running_requests


def overloaded(costs: Sequence[float], factor: float, min_cost: float) -> list[bool]:
    """Which replicas to skip: load above ``factor`` times the mean and
    above ``min_cost`` (so idle clusters never skip on noise). With
    ``factor >= 1`` the least-loaded replica is never skipped."""
    if not costs:
        return []
    limit = max(factor * sum(costs) / len(costs), min_cost)
    return [c > limit for c in costs]
