"""Per-request state of the offload connector's scheduler side.

    lookup ──► planned (chunks found, held or pinned) ──alloc──► loading ──► idle
      │  └─ None returned while a lookup or promotion is in flight
      └─ nothing found ───────────────────────────────────────────────────► idle

Chunk ``c`` of a request covers tokens ``[c * chunk_size, (c + 1) * chunk_size)``
and is keyed by the device hash of its last block. ``next_save`` is the first
chunk the connector may still have to save: chunks before it are either in the
store (found by the lookup, or saved already) or were on the device when the
request started (their owner saved them).
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvstrata.io import ChunkKey, MemoryObj
from kvstrata.io.memory import release_all

L1 = 0  # source index of CPU memory; lower tier i is i + 1


class LoadPlan:
    """Chunks ``[start, start + len(keys))`` found in the store.

    ``objs`` (sync loads) are references to the L1 objects, taken at lookup so
    nothing evicts them before the worker reads them; ``pins`` keep the chunks
    of an asynchronous load in their tiers until the fetch holds them."""

    __slots__ = ("start", "keys", "srcs", "token_end", "objs", "pins", "is_async")

    def __init__(self, start: int, keys: list[ChunkKey], srcs: list[int], token_end: int) -> None:
        self.start = start
        self.keys = keys
        self.srcs = srcs
        self.token_end = token_end  # one past the last token the chunks cover
        self.objs: list[MemoryObj] = []
        self.pins: list[tuple[Any, ChunkKey]] = []
        self.is_async = False

    def release(self) -> None:
        """Drop every reference and pin this plan holds (idempotent)."""
        objs, self.objs = self.objs, []
        release_all(objs)
        pins, self.pins = self.pins, []
        for tier, key in pins:
            tier.unpin(key)


class RequestTracker:
    """Owns: one request's lookup, plan, in-flight fetch and save progress.
    Owned by the scheduler side; loop only."""

    __slots__ = ("request", "block_ids", "next_save", "plan", "lookup", "fetch", "fetched",
                 "load_blocks", "load_skip", "load_limit", "loading", "finished", "hit_tokens",
                 "hit_tier", "load_s")

    def __init__(self, request: Any) -> None:
        self.request = request
        self.block_ids: list[int] = []
        self.next_save = 0
        self.plan: LoadPlan | None = None
        self.lookup: asyncio.Task | None = None  # async lookup -> number of chunks found
        self.fetch: asyncio.Task | None = None  # store.get of the plan's chunks
        self.fetched: list[MemoryObj] | None = None  # its result, refs held
        self.load_blocks: list[int] = []  # blocks the plan's chunks cover (all of the chunks)
        self.load_skip = 0  # leading tokens of the first chunk the device already has
        self.load_limit = 0  # tokens to load, counted from the first chunk's start
        self.loading = False  # allocated, waiting for its chunks (WAITING_FOR_REMOTE_KVS)
        self.finished = False
        self.hit_tokens = 0
        self.hit_tier: dict[str, int] = {}
        self.load_s = 0.0

    @property
    def req_id(self) -> str:
        return self.request.request_id

    def drop_plan(self) -> None:
        """Forget the plan and whatever it holds; cancel an unfinished fetch or
        lookup (their results are released by their done callbacks)."""
        if self.plan is not None:
            self.plan.release()
            self.plan = None
        for task in (self.lookup, self.fetch):
            if task is not None and not task.done():
                task.cancel()
        self.lookup = self.fetch = None
        if self.fetched is not None:
            release_all(self.fetched)
            self.fetched = None
        self.loading = False


def chunk_keys(fingerprint: str, block_hashes: list, blocks_per_chunk: int, block_size: int,
               start: int, stop: int) -> list[ChunkKey]:
    """Keys of the full chunks ``[start, stop)`` (their last blocks' hashes)."""
    cs = blocks_per_chunk * block_size
    return [ChunkKey(fingerprint, block_hashes[(c + 1) * blocks_per_chunk - 1], cs) for c in range(start, stop)]
