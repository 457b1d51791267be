"""Finding a request's chunks in the store without blocking the scheduler.

``probe`` answers from what the tiers know without I/O: L1's index, a disk
tier's in-memory index. It stops at the first chunk no tier has (a definite
answer) or at the first chunk only I/O can settle (a Redis or shared-fs tier
that cannot tell without asking): then the scheduler side starts ``lookup``
(``StorageManager.lookup`` under a timeout) and answers "not known yet".

Sources are tier indices: 0 is L1, ``i + 1`` is ``store.tiers[i]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import structlog

from kvstrata.io import ChunkKey, MemoryObj, StorageManager
from kvstrata.connector.offload.tracker import L1

log = structlog.get_logger(__name__)


def probe(store: StorageManager, keys: Sequence[ChunkKey]) -> tuple[list[int], bool]:
    """(source of each leading chunk known without I/O, whether the answer is
    definite). An L1 entry still being filled counts as a lower-tier chunk
    (source -1 is never returned; such an entry is a source 0 only when ready)."""
    l1, tiers = store.l1, store.tiers
    srcs: list[int] = []
    for key in keys:
        if l1.contains(key) and l1.in_flight(key) is None:
            srcs.append(L1)
            continue
        src, known = _lower_source(tiers, key)
        if src is None:
            return srcs, known
        srcs.append(src)
    return srcs, True


def _lower_source(tiers: Sequence[Any], key: ChunkKey) -> tuple[int | None, bool]:
    for i, tier in enumerate(tiers):
        if not tier.available:
            continue
        try:
            has = tier.has(key)
        except Exception:  # a broken tier is a miss, never the scheduler's crash
            log.exception("tier_has_failed", tier=tier.name)
            continue
        if has is True:
            return i + 1, True
        if has is None:
            return None, False
    return None, True


def probe_partial(store: StorageManager, fingerprint: str, block_hashes: Sequence[bytes], chunk: int,
                  blocks_per_chunk: int, block_size: int, missing: ChunkKey) -> tuple[ChunkKey, int] | None:
    """The longest partial chunk starting at ``chunk`` that L1 or a local
    tier holds (a finished or preempted request saved it: the tail of a
    conversation turn), shorter than ``missing``; None if there is none."""
    first = chunk * blocks_per_chunk
    last = min(len(block_hashes), first + blocks_per_chunk) - 1
    for j in range(last, first - 1, -1):
        key = ChunkKey(fingerprint, block_hashes[j], (j - first + 1) * block_size)
        if key == missing or key.num_tokens >= missing.num_tokens:
            continue
        srcs, _ = probe(store, [key])
        if srcs:
            return key, srcs[0]
    return None


def guess_source(store: StorageManager, key: ChunkKey) -> int:
    """Where ``lookup`` most likely found ``key``: L1, a tier that says so,
    else the first tier that cannot tell (the one the lookup asked)."""
    if store.l1.contains(key):
        return L1
    unknown = None
    for i, tier in enumerate(store.tiers):
        has = tier.has(key)
        if has is True:
            return i + 1
        if has is None and unknown is None:
            unknown = i + 1
    return unknown if unknown is not None else len(store.tiers)


def all_ready_in_l1(store: StorageManager, srcs: Sequence[int]) -> bool:
    return all(s == L1 for s in srcs)


LOCAL_KINDS = frozenset({"cpu", "disk"})


def all_local(store: StorageManager, srcs: Sequence[int]) -> bool:
    """Every chunk in L1 or on a local disk tier (reads of short, known latency)."""
    tiers = store.tiers
    return all(s == L1 or (0 < s <= len(tiers) and tiers[s - 1].kind in LOCAL_KINDS) for s in srcs)


def take_l1(store: StorageManager, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
    """References to the leading ``keys`` ready in L1 (stops at the first that is not)."""
    l1 = store.l1
    objs: list[MemoryObj] = []
    for key in keys:
        if l1.in_flight(key) is not None:
            break
        obj = l1.take(key)
        if obj is None:
            break
        objs.append(obj)
    return objs


def pin_chunks(store: StorageManager, keys: Sequence[ChunkKey], srcs: Sequence[int]) -> list[tuple[Any, ChunkKey]]:
    """Pin each chunk in its source tier where that tier can pin; returns what to unpin."""
    pins: list[tuple[Any, ChunkKey]] = []
    for key, src in zip(keys, srcs, strict=True):
        tier = store.l1 if src == L1 else store.tiers[src - 1]
        try:
            if tier.pin(key):
                pins.append((tier, key))
        except Exception:
            log.exception("tier_pin_failed", tier=tier.name)
    return pins


async def lookup(store: StorageManager, keys: Sequence[ChunkKey], timeout_s: float) -> int:
    """Leading chunks some tier holds; 0 after ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            return await store.lookup(keys)
    except TimeoutError:
        log.warning("store_lookup_timeout", chunks=len(keys), timeout_s=timeout_s)
        return 0


async def fetch(store: StorageManager, keys: Sequence[ChunkKey], timeout_s: float,
                pins: list[tuple[Any, ChunkKey]]) -> list[MemoryObj]:
    """The leading chunks, each referenced for the caller, promoted into L1;
    fewer (or none) when a tier fails or ``timeout_s`` passes. Unpins ``pins``
    once the fetch holds its references."""
    try:
        async with asyncio.timeout(timeout_s):
            return await store.get(keys)
    except TimeoutError:
        log.warning("store_fetch_timeout", chunks=len(keys), timeout_s=timeout_s)
        return []
    finally:
        for tier, key in pins:
            tier.unpin(key)
