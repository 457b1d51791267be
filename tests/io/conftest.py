"""Fixtures of the tiered-store tests (builders live in io_helpers).

The autouse ``no_leaks`` check runs after every test: once their I/O has
ended, every store, tier, allocator and executor the test built through these
fixtures must hold no pin and no reference beyond the tiers' own; after
closing them no I/O job is pending, every L1 byte is back in its allocator,
and no asyncio task the test started is left running. (I/O may outlive the
call that started it: a ``get`` that stops at a failed read returns while
its later reads still run, each holding its L1 destination until it ends;
that is not a leak, and on a loaded host it may take a while.)
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from io_helpers import REDIS_BIN, RedisServer, TinyFS

from kvstrata.io import (
    CPUConfig,
    CPUTier,
    Outstanding,
    PriorityExecutor,
    StorageManager,
    StoreConfig,
    TierSpec,
)


class Tracker:
    """What one test built; checked and closed by ``no_leaks``."""

    def __init__(self) -> None:
        self.stores: list[StorageManager] = []
        self.tiers: list = []
        self.allocators: list = []
        self.executors: list[PriorityExecutor] = []
        self.l1_tiers: list[CPUTier] = []

    def add(self, thing):
        if isinstance(thing, StorageManager):
            self.stores.append(thing)
        elif isinstance(thing, CPUTier):
            self.l1_tiers.append(thing)
        elif isinstance(thing, PriorityExecutor):
            self.executors.append(thing)
        elif hasattr(thing, "submit_read"):
            self.tiers.append(thing)
        else:
            self.allocators.append(thing)
        return thing


@pytest.fixture
def tracker() -> Tracker:
    return Tracker()


@pytest.fixture(autouse=True)
async def no_leaks(tracker: Tracker):
    yield
    for s in tracker.stores:
        async with asyncio.timeout(30):  # a job that never ends is a leak: fail, do not hang
            await s.drain()
        out = s.outstanding()
        assert out.pinned == 0 and out.referenced == 0, f"store leaked {out}"
        await s.aclose()
        assert s.outstanding() == Outstanding(), "pending I/O after close"
        assert s.l1.allocator.num_live == 0, "L1 bytes not returned after close"
    for l1 in tracker.l1_tiers:
        held = l1.objects()
        assert all(o.pin_count == 0 and o.ref_count == 1 for o in held), f"L1 leaked {held}"
        assert l1.allocator.num_live == len(held), "objects referenced outside the tier"
        l1.clear()
        assert l1.allocator.num_live == 0
    for t in tracker.tiers:
        assert t.pinned_count() == 0
        await t.aclose()
        assert t.pending == 0
    for e in tracker.executors:
        await e.aclose()
        assert e.pending == 0
    for a in tracker.allocators:
        assert a.num_live == 0, f"allocator still holds {a.live_objects()}"
    me = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    assert not left, f"tasks left running: {left}"


@pytest.fixture
def make_store(tracker: Tracker, tmp_path: Path):
    """``await make_store(cpu_objs=4, disk=..., tiers=[...], **store_kw)``:
    a started StorageManager with an L1 of ``cpu_objs`` test objects."""

    async def make(*, cpu_objs: int = 8, policy: str = "lru", tiers=(), allocator: str = "first_fit",
                   slot_bytes: int | None = None, **kw) -> StorageManager:
        cpu = CPUConfig(capacity_bytes=cpu_objs * 8192, policy=policy, allocator=allocator,
                        slot_bytes=slot_bytes, pin_memory=False)
        specs = tuple(t if isinstance(t, TierSpec) else TierSpec(**t) for t in tiers)
        store = tracker.add(StorageManager(StoreConfig(cpu=cpu, tiers=specs, **kw)))
        await store.start()
        return store

    return make


def disk_spec(path: Path, *, objs: int = 16, write: str = "through", name: str = "disk", **opts) -> TierSpec:
    options = dict(path=str(path), capacity_bytes=objs * (4096 + 8192),
                   health=dict(retry_interval_s=0.05, max_retry_interval_s=0.1))
    options.update(opts)
    return TierSpec(type="disk", name=name, write=write, options=options)


@pytest.fixture
def disk_tier_spec():
    return disk_spec


def _redis_or_skip() -> None:
    if not os.path.exists(REDIS_BIN):
        if os.environ.get("KVSTRATA_REQUIRE_REDIS") == "1":
            pytest.fail(f"redis-server not found at {REDIS_BIN} and KVSTRATA_REQUIRE_REDIS=1")
        pytest.skip("redis-server not installed")


@pytest.fixture
def redis_factory(tmp_path: Path):
    """``redis_factory(*extra_args)`` -> a started RedisServer, killed at the end."""
    _redis_or_skip()
    servers: list[RedisServer] = []

    def make(*extra: str, start: bool = True) -> RedisServer:
        d = tmp_path / f"redis{len(servers)}"
        d.mkdir()
        server = RedisServer(d, *extra)
        servers.append(server)
        if start:
            server.start()
        return server

    yield make
    for s in servers:
        s.kill()


@pytest.fixture
def redis_server(redis_factory) -> RedisServer:
    return redis_factory()


@pytest.fixture
def tiny_fs(tmp_path: Path):
    """A 64 KiB tmpfs (real ENOSPC); skipped where unprivileged mount
    namespaces are not allowed."""
    try:
        fs = TinyFS(tmp_path / "mnt", 64)
    except OSError as e:
        pytest.skip(f"no private tmpfs: {e}")
    yield fs
    fs.close()
