"""One request's load, on the offload connector's scheduler side::

    lookup ──► planned (chunks found, held or pinned) ──alloc──► handover ──► idle
      │  └─ None returned while a lookup or promotion is in flight
      └─ nothing found ─────────────────────────────────────────────────────► idle

``handover`` says how the chunks reach the worker once the request's blocks
are allocated: "layer" (held in L1: within the next step, layer by layer) or
"bulk" (fetched from a lower tier: before the forward of the step after the
fetch lands, the request waiting in WAITING_FOR_REMOTE_KVS meanwhile).
"""

from __future__ import annotations

import asyncio
from typing import Literal

from kvstrata.connector.base import ConnectorRequest
from kvstrata.io import ChunkKey, MemoryObj, Pin, StorageManager
from kvstrata.io.memory import release_all


class LoadPlan:
    """Chunks ``[start, start + len(keys))`` found in the store, at sources
    ``srcs`` (``kvstrata.io.sources``).

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
        self.pins: list[Pin] = []
        self.is_async = False

    def cut(self, n: int, chunk_size: int) -> None:
        """Keep the first ``n`` chunks (what the store could deliver)."""
        self.keys, self.srcs = self.keys[:n], self.srcs[:n]
        self.token_end = self.start * chunk_size + sum(k.num_tokens for k in self.keys)

    def release(self, store: StorageManager) -> None:
        """Drop every reference and pin this plan holds (idempotent)."""
        objs, self.objs = self.objs, []
        release_all(objs)
        pins, self.pins = self.pins, []
        store.release_pins(pins)


class LoadTracker:
    """Owns: one request's lookup, plan, in-flight fetch and load progress.
    Owned by the LoadPlanner; loop only."""

    __slots__ = ("request", "plan", "lookup", "fetch", "fetched", "load_blocks", "load_skip", "load_limit",
                 "handover", "hit_tokens", "hit_tier", "load_s", "query_tokens", "split_at", "fetch_eta")

    def __init__(self, request: ConnectorRequest) -> None:
        self.request = request
        self.plan: LoadPlan | None = None
        self.lookup: asyncio.Task[list[int]] | None = None  # the sources of the chunks a lookup found
        self.fetch: asyncio.Task[None] | None = None  # store.get of the plan's chunks, into ``fetched``
        self.fetched: list[MemoryObj] | None = None  # its result, refs held
        self.load_blocks: list[int] = []  # the blocks the loaded chunks go to (all of the chunks)
        self.load_skip = 0  # leading tokens of the first chunk the device already has
        self.load_limit = 0  # tokens to load, counted from the first chunk's start
        self.handover: Literal["layer", "bulk"] | None = None  # allocated: how the chunks reach the worker
        self.hit_tokens = 0
        self.hit_tier: dict[str, int] = {}
        self.load_s = 0.0
        self.query_tokens = 0  # tokens its last lookup asked the store about (booked at finish, with the hit)
        # Load or compute (``costs.choose_split``): the chunks before this one
        # are computed while the fetch reads the plan's chunks; None: no split.
        self.split_at: int | None = None
        self.fetch_eta: float | None = None  # when the split's fetch is expected to land (perf_counter)

    @property
    def req_id(self) -> str:
        return self.request.request_id

    def drop_plan(self, store: StorageManager) -> None:
        """Forget the plan and whatever it holds; cancel an unfinished fetch or
        lookup (a fetch that finds itself dropped releases what it got)."""
        if self.plan is not None:
            self.plan.release(store)
            self.plan = None
        for task in (self.lookup, self.fetch):
            if task is not None and not task.done():
                task.cancel()
        self.lookup = self.fetch = None
        self.split_at = None
        self.fetch_eta = None
        if self.fetched is not None:
            release_all(self.fetched)
            self.fetched = None
        self.handover = None
