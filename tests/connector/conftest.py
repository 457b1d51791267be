"""Fixtures of the connector tests: a tiny HF Llama (the oracle), engines
with connectors over real tiers, a real redis-server, and the autouse leak
check: after every test, each engine it built is idle with every device
block free, every L1 buffer and pin returned, no buffer lent, no request
tracked, no I/O pending; after closing, every L1 byte is back in its
allocator and no task the test started is left running."""

from __future__ import annotations

import asyncio
import os

import pytest
from conn_helpers import BLOCK, Oracle, RedisServer, build_tiny_llama, redis_available

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from kvstrata.enginecore import AsyncEngine, EngineCore
from kvstrata.enginecore.builder import build_engine_core
from kvstrata.io import Outstanding
from kvstrata.connector import KVConnectorFactory
from kvstrata.connector.multi import MultiConnector
from kvstrata.connector.offload import OffloadConnector


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    return rep


# Every engine these tests build without choosing a stepping mode can run
# with async scheduling on ("1") or off ("0"): KVSTRATA_TEST_ASYNC_SCHEDULING;
# unset, the engine's default (off on a CPU).
ASYNC_SCHEDULING = {"1": True, "0": False}.get(os.environ.get("KVSTRATA_TEST_ASYNC_SCHEDULING", ""))


@pytest.fixture(scope="session")
def oracle(tmp_path_factory) -> Oracle:
    path = tmp_path_factory.mktemp("tiny_llama")
    return Oracle(str(path), build_tiny_llama(path, seed=5))


def offload_bundles(connector) -> list[OffloadConnector]:
    if isinstance(connector, OffloadConnector):
        return [connector]
    if isinstance(connector, MultiConnector):
        return [b for c in connector.children for b in offload_bundles(c)]
    return []


class Built:
    """What a test built, checked by ``no_leaks``."""

    def __init__(self) -> None:
        self.engines: list[AsyncEngine] = []
        self.cores: list[tuple[EngineCore, object]] = []


@pytest.fixture
def built() -> Built:
    return Built()


@pytest.fixture
def make_engine(oracle, built):
    async def make(kv_transfer=None, *, num_blocks: int = 64, caching: bool = True, device: str = "cpu",
                   speculative: SpeculativeConfig | None = None, **sched) -> AsyncEngine:
        if ASYNC_SCHEDULING is not None:
            sched.setdefault("async_scheduling", ASYNC_SCHEDULING)
        config = EngineConfig(
            model=ModelConfig(model=oracle.path),
            cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks, enable_prefix_caching=caching),
            scheduler=SchedulerConfig(**sched), device=device, kv_transfer=kv_transfer,
            speculative=speculative or SpeculativeConfig(),
        )
        engine = await AsyncEngine.start(config)
        built.engines.append(engine)
        return engine

    return make


@pytest.fixture(params=["serial", "async"])
def stepping(request) -> dict[str, bool]:
    """``make_engine``'s scheduler option for each way of stepping: serial,
    and async scheduling (step N+1 scheduled, its connector metadata built,
    while step N runs). Check with ``conn_helpers.assert_stepped``."""
    return {"async_scheduling": request.param == "async"}


@pytest.fixture
def make_core(oracle, built):
    """An EngineCore driven step by step by the test (on the loop thread: the
    worker side never touches the loop), with its connector opened here."""

    async def make(kv_transfer, *, num_blocks: int = 64, **sched) -> EngineCore:
        connector = await KVConnectorFactory().open(kv_transfer)
        config = EngineConfig(model=ModelConfig(model=oracle.path),
                              cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                              scheduler=SchedulerConfig(**sched), device="cpu")
        core = await asyncio.to_thread(build_engine_core, config, None, connector)
        built.cores.append((core, connector))
        return core

    return make


def assert_idle(core: EngineCore) -> list:
    kv, sched = core.kv, core.scheduler
    assert not sched.requests and not sched.transfers.has_pending()
    assert kv.num_free_blocks == kv.num_blocks - 1, f"{kv.num_blocks - 1 - kv.num_free_blocks} device blocks in use"
    bundles = offload_bundles(core.kv_connector)
    for b in bundles:
        assert b.store.outstanding().pinned == 0 and b.store.outstanding().referenced == 0, (
            f"store leaked {b.store.outstanding()}")
        assert len(b.lender) == 0 and not b.lender.buffers, "buffers still lent to the worker"
        assert not b.scheduler.tracked(), f"requests still tracked: {b.scheduler.tracked()}"
        assert b.store.l1.allocator.num_live == len(b.store.l1.objects()), "L1 buffers referenced outside the store"
    return bundles


async def assert_idle_and_close(engine: AsyncEngine) -> None:
    """The leak check for one engine (then closes it)."""
    await engine.flush_kv()
    bundles = assert_idle(engine.core)
    for b in bundles:
        assert b.store.outstanding() == Outstanding(), f"store leaked {b.store.outstanding()}"
    await engine.aclose()
    for b in bundles:
        assert b.store.l1.allocator.num_live == 0, "L1 bytes not returned after close"


@pytest.fixture(autouse=True)
async def no_leaks(request, built):
    yield
    rep = getattr(request.node, "rep_call", None)
    passed = rep is not None and rep.passed
    for engine in built.engines:
        if passed and not engine._closed:
            await assert_idle_and_close(engine)
        else:
            await engine.aclose()
    for core, connector in built.cores:
        if passed:
            assert_idle(core)
        await connector.aclose()
        if passed:
            for b in offload_bundles(connector):
                assert b.store.l1.allocator.num_live == 0, "L1 bytes not returned after close"
    if passed:
        me = asyncio.current_task()
        left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        assert not left, f"tasks left running: {left}"


@pytest.fixture
def redis_server(tmp_path):
    if not redis_available():
        pytest.skip("redis-server not installed")
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()
