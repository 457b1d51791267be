"""Tier registry: built-in names, a user tier loaded by dotted path and
driven by the store, config errors that name the field, and a broken user
tier that must never raise into the caller."""

from __future__ import annotations

import textwrap

import pytest
import torch
from io_helpers import key, pattern, put_pattern

from kvstrata.io import DiskTier, StorageManager, StoreConfig, TierRegistry, TierSpec

USER_TIER = textwrap.dedent('''
    import asyncio
    from kvstrata.io.backends.base import ObjectMeta
    from kvstrata.io.memory import dtype_name
    from kvstrata.io.stats import TierCounters

    class DictTier:
        """A user tier: objects as bytes in a dict (what a plugin author writes)."""
        kind = "dict"

        def __init__(self, name, write_back, fail):
            self.name, self.write_back, self.fail = name, write_back, fail
            self.counters = TierCounters()
            self.data = {}
            self.pending = 0
            self.available = True

        @classmethod
        def from_spec(cls, spec, prefix):
            return cls(spec.name or "dict", spec.write == "back", spec.options.get("fail", False))

        def _check(self):
            if self.fail:
                raise RuntimeError("plugin bug")

        async def start(self): self._check()
        def has(self, key): self._check(); return key in self.data
        async def metas(self, keys):
            self._check()
            return [self.data[k][0] if k in self.data else None for k in keys]
        def submit_put(self, key, obj):
            self._check()
            meta = ObjectMeta(obj.shape, dtype_name(obj.dtype), obj.layout, obj.nbytes)
            self.data[key] = (meta, obj.numpy_bytes().tobytes())
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(True)
            return fut
        def submit_read(self, key, meta, dst):
            self._check()
            dst.numpy_bytes()[:] = memoryview(self.data[key][1])
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(True)
            return fut
        def submit_remove(self, key): return self.data.pop(key, None) is not None
        def pin(self, key): self._check(); return False
        def unpin(self, key): pass
        def pinned_count(self): return 0
        def stats(self): return self.counters.snapshot(self.name, self.kind, available=True,
                                                       usage_bytes=0, capacity_bytes=0, num_objects=len(self.data))
        async def drain(self): pass
        async def aclose(self): self._check()
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_tiers.py").write_text(USER_TIER)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_tiers"


def test_builtin_names():
    reg = TierRegistry()
    assert reg.names() == ["disk", "fs", "redis", "redis-cluster"]
    assert reg.resolve("disk") is DiskTier
    assert reg.resolve("kvstrata.io.backends.disk.DiskTier") is DiskTier
    assert reg.resolve("kvstrata.io.backends.disk:DiskTier") is DiskTier
    assert TierRegistry(builtins=False).names() == []


async def test_a_user_tier_by_dotted_path_serves_the_store(make_store, user_module):
    store = await make_store(cpu_objs=4, tiers=[TierSpec(type=f"{user_module}.DictTier", name="mine")])
    for i in range(6):
        put_pattern(store, i)
    assert not store.l1.contains(key(0))
    objs = await store.get([key(0), key(1)])
    assert [torch.equal(o.tensor, pattern(i)) for i, o in enumerate(objs)] == [True, True]
    for o in objs:
        o.release()
    assert store.stats().tier("mine").hit_chunks == 2


async def test_a_registered_name_works_like_a_builtin(tracker, user_module):
    import importlib

    reg = TierRegistry()
    reg.register("dict", importlib.import_module(user_module).DictTier)
    store = tracker.add(StorageManager(StoreConfig(tiers=(TierSpec(type="dict"),)), registry=reg))
    await store.start()
    assert store.tiers[0].kind == "dict"


async def test_a_broken_user_tier_never_raises_into_the_caller(make_store, user_module):
    store = await make_store(cpu_objs=2, tiers=[
        TierSpec(type=f"{user_module}:DictTier", name="broken", options={"fail": False})])
    store.tiers[0].fail = True  # every call now raises
    for i in range(3):
        put_pattern(store, i)
    assert await store.lookup([key(0)]) == 0
    assert store.pin([key(0)], [1]) == []  # the tier's pin raised: no pin taken
    assert await store.get([key(0)]) == []
    objs = await store.get([key(2)])
    assert len(objs) == 1
    objs[0].release()
    store.remove(key(1))
    assert store.stats().tier("broken").faults >= 4
    store.tiers[0].fail = False


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        (TierSpec(type="nope"), ValueError, r"tiers\[0\]\.type 'nope' is not one of"),
        (TierSpec(type="no_such_module.Tier"), ValueError, r"tiers\[0\]\.type: cannot load"),
        (TierSpec(type="kvstrata.io.keys.ALL_LAYERS"), TypeError, "not a class"),
        (TierSpec(type="kvstrata.io.keys.ChunkKeyer"), TypeError, "not a class with from_spec"),
        (TierSpec(type="disk", options={"path": "/tmp/x"}), ValueError, "capacity_bytes"),
        (TierSpec(type="disk", options={"path": "/tmp/x", "capacity_bytes": 1, "colour": 1}),
         ValueError, "colour"),
        (TierSpec(type="disk", options={"path": "/tmp/x", "capacity_bytes": 1, "policy": "x"}),
         ValueError, r"tiers\[0\]\.options\.policy"),
    ],
)
def test_bad_tier_specs_name_the_field(spec, error, match):
    with pytest.raises(error, match=match):
        StorageManager(StoreConfig(tiers=(spec,)))


def test_tier_names_must_be_unique():
    with pytest.raises(ValueError, match=r"tiers\[1\]\.name"):
        StoreConfig(tiers=(TierSpec(type="disk"), TierSpec(type="disk"))).validate()


def test_register_refuses_bad_names_and_classes():
    reg = TierRegistry()
    with pytest.raises(ValueError, match="tier type name"):
        reg.register("a.b", DiskTier)
    with pytest.raises(TypeError, match="from_spec"):
        reg.register("x", int)
