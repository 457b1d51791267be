"""Model-based test: the store (L1 of 3 objects, disk of 4 files, both LRU,
write-through) against a model of two ordered dicts with capacities, with
pins and corrupted files injected. After every step the model predicts
exactly which keys each tier holds, in which eviction order, what get and
lookup return, and that no pin or reference leaks; get never returns wrong
bytes."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections import Counter, OrderedDict
from pathlib import Path

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from io_helpers import DTYPE, FILE_BYTES, IDENT, SHAPE, key, pattern

from kvstrata.io import CPUConfig, StorageManager, StoreConfig, TierSpec

L1_CAP, DISK_CAP, UNIVERSE = 3, 4, 6
keys_st = st.integers(0, UNIVERSE - 1)
key_lists = st.lists(keys_st, min_size=1, max_size=4, unique=True)


class StoreModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvstrata-model-"))
        cfg = StoreConfig(
            cpu=CPUConfig(capacity_bytes=L1_CAP * 8192, pin_memory=False),
            tiers=(TierSpec(type="disk", options=dict(
                path=str(self.dir), capacity_bytes=DISK_CAP * FILE_BYTES, io_threads=1)),),
        )
        self.runner = asyncio.Runner()
        self.store = self.runner.run(StorageManager.open(cfg))
        self.disk_tier = self.store.tiers[0]
        self.l1: OrderedDict[int, None] = OrderedDict()    # LRU first
        self.disk: OrderedDict[int, None] = OrderedDict()
        self.corrupt: set[int] = set()
        self.l1_pins: Counter[int] = Counter()
        self.disk_pins: Counter[int] = Counter()
        self.held: list[tuple[list, list[tuple[int, str]]]] = []  # (pins taken, model's (key, tier))
        self.corrupt_found = 0

    # --- model helpers -------------------------------------------------
    def _evict_l1(self, busy: set[int]) -> bool:
        for k in self.l1:
            if not self.l1_pins[k] and k not in busy:
                del self.l1[k]
                return True
        return False

    def _forget_disk(self, k: int) -> None:
        del self.disk[k]
        self.corrupt.discard(k)
        self.disk_pins.pop(k, None)

    def _write_disk(self, k: int) -> None:
        if k in self.disk:
            return
        if len(self.disk) == DISK_CAP:
            victim = next((v for v in self.disk if not self.disk_pins[v]), None)
            if victim is None:
                return  # dropped put
            self._forget_disk(victim)
        self.disk[k] = None

    # --- rules ---------------------------------------------------------
    @rule(k=keys_st)
    def put(self, k):
        room = len(self.l1) < L1_CAP or self._evict_l1(set())
        obj = self.store.allocate(SHAPE, DTYPE, "test")
        assert (obj is not None) == room
        if obj is None:
            return
        obj.tensor.copy_(pattern(k))

        async def put_and_drain() -> bool:  # the store is loop-owned: put on the loop
            stored = self.store.put(key(k), obj)
            obj.release()
            await self.store.drain()
            return stored

        assert self.runner.run(put_and_drain()) == (k not in self.l1)
        if k not in self.l1:
            self.l1[k] = None
            self._write_disk(k)

    @rule(ks=key_lists)
    def get(self, ks):
        n = next((i for i, k in enumerate(ks) if k not in self.l1 and k not in self.disk), len(ks))
        busy = {k for k in ks[:n] if k in self.l1}
        stop = n
        promoted = []
        for i, k in enumerate(ks[:n]):
            if k in self.l1:
                continue
            if len(self.l1) == L1_CAP and not self._evict_l1(busy):
                stop = i
                break
            self.l1[k] = None
            busy.add(k)
            promoted.append((i, k))
        served = stop
        for i, k in promoted:  # reads complete in submission order (one I/O thread)
            if k in self.corrupt:
                del self.l1[k]
                self._forget_disk(k)
                self.corrupt_found += 1
                served = min(served, i)
            else:
                self.disk.move_to_end(k)
        for k in reversed(ks[:served]):
            self.l1.move_to_end(k)

        objs = self.runner.run(self.store.get([key(k) for k in ks]))
        try:
            assert len(objs) == served
            for k, o in zip(ks, objs):
                assert torch.equal(o.tensor, pattern(k)), f"wrong bytes for key {k}"
        finally:
            for o in objs:
                o.release()
        self.runner.run(self.store.drain())

    @rule(ks=key_lists)
    def lookup(self, ks):
        n = next((i for i, k in enumerate(ks) if k not in self.l1 and k not in self.disk), len(ks))
        assert self.runner.run(self.store.lookup([key(k) for k in ks])) == n

    @rule(ks=key_lists)
    def pin(self, ks):
        n = next((i for i, k in enumerate(ks) if k not in self.l1 and k not in self.disk), len(ks))
        keys = [key(k) for k in ks]
        srcs = self.runner.run(self.store.locate(keys))
        pins = self.store.pin(keys[: len(srcs)], srcs)
        tiers = ["l1" if k in self.l1 else "disk" for k in ks[:n]]
        assert pins == [(key(k), 0 if t == "l1" else 1) for k, t in zip(ks, tiers)]  # where the model has them
        for k, t in zip(ks, tiers):
            (self.l1_pins if t == "l1" else self.disk_pins)[k] += 1
        self.held.append((pins, list(zip(ks, tiers))))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release_pins(self, data):
        pins, model = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.store.release_pins(pins)
        for k, t in model:
            pins_of = self.l1_pins if t == "l1" else self.disk_pins
            if pins_of[k]:  # a forgotten disk file took its pins with it
                pins_of[k] -= 1

    @rule(k=keys_st)
    def remove(self, k):
        async def remove() -> None:
            self.store.remove(key(k))

        self.runner.run(remove())
        if k in self.l1 and not self.l1_pins[k]:
            del self.l1[k]
        if k in self.disk and not self.disk_pins[k]:
            self._forget_disk(k)
        self.runner.run(self.store.drain())

    @precondition(lambda self: set(self.disk) - self.corrupt)
    @rule(data=st.data())
    def corrupt_file(self, data):
        k = data.draw(st.sampled_from(sorted(set(self.disk) - self.corrupt)))
        path = self.dir / IDENT / f"{key(k).name}.kvs"
        raw = bytearray(path.read_bytes())
        raw[4096 + data.draw(st.integers(0, 8191))] ^= 0x10
        path.write_bytes(bytes(raw))
        self.corrupt.add(k)

    # --- invariants ----------------------------------------------------
    @invariant()
    def tiers_match_the_model(self):
        ids = {key(k): k for k in range(UNIVERSE)}
        assert [ids[k] for k in self.store.l1.policy.victims(UNIVERSE)] == list(self.l1)
        assert [ids[k] for k in self.disk_tier.policy.victims(UNIVERSE)] == list(self.disk)
        s = self.store.stats()
        assert s.tier("cpu").usage_bytes == len(self.l1) * 8192
        assert s.tier("disk").usage_bytes == len(self.disk) * FILE_BYTES
        assert s.tier("disk").corrupt == self.corrupt_found

    @invariant()
    def no_leaked_refs_or_pins(self):
        out = self.store.outstanding()
        assert out.referenced == 0 and out.pending_jobs == 0
        assert out.pinned == sum(1 for c in self.l1_pins.values() if c) + sum(
            1 for c in self.disk_pins.values() if c)

    def teardown(self):
        try:
            for pins, _ in self.held:
                self.store.release_pins(pins)
            assert self.store.outstanding().pinned == 0
            self.runner.run(self.store.aclose())
            assert self.store.l1.allocator.num_live == 0
        finally:
            self.runner.close()
            shutil.rmtree(self.dir, ignore_errors=True)


TestStoreModel = StoreModel.TestCase
TestStoreModel.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)
