"""CacheBlend on the offload connector's scheduler side: each segment's own
KV, stored under a key of its tokens alone, found wherever the segment sits.

A request with ``sampling_params.blend`` names token spans of its prompt
(passages) whose KV may come from the store even though they are not a
prefix. Each span's KV is stored as computed on its own, from position 0,
under a key made of the store identity and a hash of the span's tokens (no
position, no prefix: the same passage anywhere in any prompt has one key).
For a blend request that has no device hit (its block hashes are salted
with the blend spec, so past the tokens before the first segment only an
identical blend request hits on the device):

    match        keys the spans; takes the ones ready in L1, starts a fetch
                 (promotion into L1) of those on a lower tier and answers None
                 until it lands; then answers the tokens up to the last span's
                 end as external (loaded within the step, synchronously)
    hand_over    lends the found segments' buffers and, for the missing ones,
                 fresh L1 buffers for the worker to fill (the segment computed
                 on its own), as ``BlendLoad`` entries of the step's metadata
    (worker)     blends: re-rotates and concatenates the segments' KV,
                 recomputes ``recompute_ratio`` of the tokens (model side,
                 ``kvstrata.worker.blend``), writes the result into the
                 request's blocks, fills the save buffers
    (settle)     saved segment buffers go into the store like any save

Owns: each blend request's keys, the segments it holds and its blocks, from
its first lookup until it is handed over, preempted or finished. Loop only.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Coroutine
from typing import Any

import torch

from kvstrata.connector.base import ConnectorRequest
from kvstrata.connector.metadata import BlendLoad
from kvstrata.connector.metrics import TransferMetrics
from kvstrata.connector.offload.lending import Lender, Lent
from kvstrata.io import L1_SOURCE, ChunkKey, MemoryObj, StorageManager
from kvstrata.io.memory import release_all
from kvstrata.types import BlendSpec

_SEGMENT_TAG = b"kvstrata-segment-v1"

# The LoadPlanner's task spawner; Any: a coroutine's yield and send types, as asyncio's create_task
Spawner = Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]


def segment_key(fingerprint: str, token_ids: list[int]) -> ChunkKey:
    """The store key of a segment's own KV: the identity and its tokens only."""
    h = hashlib.sha256(_SEGMENT_TAG)
    h.update(len(token_ids).to_bytes(4, "little"))
    for t in token_ids:
        h.update(t.to_bytes(4, "little"))
    return ChunkKey(fingerprint, h.digest(), len(token_ids))


class _Blend:
    __slots__ = ("request", "keys", "objs", "fetch", "fetched", "blocks", "end", "ratio", "spans", "skip")

    def __init__(self, request: ConnectorRequest, keys: list[ChunkKey], spans: list[tuple[int, int]],
                 ratio: float) -> None:
        self.request = request
        self.keys = keys
        self.spans = spans
        self.ratio = ratio
        self.end = spans[-1][1]
        self.skip = 0  # leading tokens the device already holds (before the first segment)
        self.objs: list[MemoryObj | None] | None = None  # per segment: its stored KV (a reference), or None
        self.fetch: asyncio.Task[None] | None = None  # promotion of the segments on lower tiers
        self.fetched: dict[int, MemoryObj] = {}  # its results so far (references)
        self.blocks: list[int] | None = None  # allocated: the blocks covering [0, end)

    def release(self) -> None:
        if self.fetch is not None and not self.fetch.done():
            self.fetch.cancel()
        self.fetch = None
        fetched, self.fetched = self.fetched, {}
        objs, self.objs = self.objs, None
        release_all([*fetched.values(), *(o for o in objs or [] if o is not None)])


def blend_of(request: ConnectorRequest) -> BlendSpec | None:
    params = getattr(request, "sampling_params", None)
    return None if params is None else params.blend


class SegmentPlanner:
    """Owns: each blend request's segment keys, the segments it holds (or
    fetches) and its blocks, until handed over, preempted or finished."""

    def __init__(self, store: StorageManager, fingerprint: str, lender: Lender, metrics: TransferMetrics,
                 spawn: Spawner, *, block_size: int, num_layers: int, num_kv_heads: int, head_size: int,
                 dtype: torch.dtype) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.lender = lender
        self.metrics = metrics
        self.spawn = spawn  # the LoadPlanner's task spawner (tracked, wakes the engine when done)
        self.block_size = block_size
        self.dims = (num_layers, num_kv_heads, head_size)
        self.dtype = dtype
        self._reqs: dict[str, _Blend] = {}

    def tracked(self) -> list[str]:
        return list(self._reqs)

    def match(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[bool, int | None]:
        """(is a blend request this planner serves, tokens to load or None while fetching)."""
        blend = blend_of(request)
        if blend is None or num_computed_tokens > blend.segments[0][0]:
            return False, 0  # not a blend, or an identical blend's blocks are on the device
        rid = request.request_id
        b = self._reqs.get(rid)
        if b is None:
            toks = list(request.all_token_ids)
            spans = [(int(s), int(e)) for s, e in blend.segments]
            keys = [segment_key(self.fingerprint, toks[s:e]) for s, e in spans]
            b = self._reqs[rid] = _Blend(request, keys, spans, float(blend.recompute_ratio))
            self.metrics.count("blend_requests")
        if b.objs is None:
            if b.fetch is None:
                lower = [i for i, key in enumerate(b.keys)
                         if (srcs := self.store.probe([key])[0]) and srcs[0] != L1_SOURCE]
                if lower:
                    b.fetch = self.spawn(self._fetch(b, lower))
            if b.fetch is not None and not b.fetch.done():
                return True, None
            self._take(b)
        b.skip = num_computed_tokens
        return True, b.end - num_computed_tokens

    def _take(self, b: _Blend) -> None:
        """Every segment: fetched from a lower tier, else ready in L1, else None (computed)."""
        objs: list[MemoryObj | None] = []
        for i, key in enumerate(b.keys):
            obj = b.fetched.pop(i, None)
            if obj is None:
                got = self.store.take_ready([key])
                obj = got[0] if got else None
            objs.append(obj)
        b.objs = objs

    async def _fetch(self, b: _Blend, lower: list[int]) -> None:
        """Promote the segments on lower tiers, all at once (each is its own
        object: one ``get`` each, since a ``get`` stops at its first miss)."""
        got = await asyncio.gather(*(self.store.get([b.keys[i]]) for i in lower))
        if self._reqs.get(b.request.request_id) is not b:
            release_all([o for objs in got for o in objs])
            return
        for i, objs in zip(lower, got, strict=True):
            if objs:
                b.fetched[i] = objs[0]

    def allocated(self, request: ConnectorRequest, block_ids: tuple[list[int], ...], num_external_tokens: int) -> None:
        b = self._reqs.get(request.request_id)
        if b is None:
            return
        if num_external_tokens < b.end - b.skip or b.objs is None:
            self.finish(request.request_id)  # not blended after all (e.g. the prompt got shorter)
            return
        b.blocks = list(block_ids[0][: -(-b.end // self.block_size)])

    def hand_over(self) -> list[BlendLoad]:
        """This step's blends (requests allocated since the last step)."""
        out: list[BlendLoad] = []
        for rid, b in list(self._reqs.items()):
            if b.blocks is None:
                continue
            del self._reqs[rid]
            objs, b.objs = b.objs or [], None
            cached, saves = [], []
            layers, heads, size = self.dims
            for key, obj, (s, e) in zip(b.keys, objs, b.spans, strict=True):
                if obj is not None:
                    cached.append(self.lender.lend(Lent(obj, key, rid)))
                    saves.append(-1)
                    self.metrics.count("blend_segment_hits")
                    continue
                cached.append(-1)
                self.metrics.count("blend_segment_misses")
                buf = None if self.store.holds(key) else self.store.allocate((layers, 2, e - s, heads, size),
                                                                             self.dtype, "kv")
                saves.append(-1 if buf is None else self.lender.lend(Lent(buf, key, rid)))
            toks = list(b.request.all_token_ids[: b.end])
            out.append(BlendLoad(rid, toks, b.spans, cached, saves, b.blocks, b.ratio, b.skip))
        return out

    def finish(self, req_id: str) -> None:
        b = self._reqs.pop(req_id, None)
        if b is not None:
            b.release()

    def has_pending(self) -> bool:
        return any(b.blocks is not None for b in self._reqs.values())

    def close(self) -> None:
        for b in self._reqs.values():
            b.release()
        self._reqs.clear()
