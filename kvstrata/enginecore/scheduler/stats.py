"""Counters the scheduler bumps once per event (never logged per token)."""

from __future__ import annotations


class SchedulerCounters:
    """Owned by the Scheduler; read by EngineCore.stats()."""

    __slots__ = (
        "num_preemptions", "num_finished", "num_generated_tokens",
        "num_prompt_tokens",
    )

    def __init__(self) -> None:
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0  # of every request added
        # Hits are counted where they are known: device prefix-cache hits by
        # the KV cache manager, tier hits by the connector (``hit_tokens``).
