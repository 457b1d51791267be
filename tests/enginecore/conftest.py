"""Fixtures of the engine-core tests: KV managers a test builds are
checked at its end (every block free), scheduler harnesses, engine cores,
AsyncEngines.
The builders themselves live in ``engine_fakes``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from engine_fakes import FakeRunner, SchedulerHarness, engine_config, make_scheduler

from kvstrata.enginecore.builder import build_engine_core
from kvstrata.enginecore.engine_core import EngineCore
from kvstrata.kv import KVCacheManager


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    return rep


@pytest.fixture
def kv_managers() -> list[KVCacheManager]:
    return []


@pytest.fixture(autouse=True)
def all_blocks_free_after_test(request, kv_managers):
    """Every KV manager a test built ends with every block free (cached or not)."""
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is None or rep.failed:
        return  # the test's own failure says more
    for kv in kv_managers:
        assert kv.num_free_blocks == kv.num_blocks - 1, (
            f"{kv.num_blocks - 1 - kv.num_free_blocks} KV blocks still in use after the test"
        )


@pytest.fixture
def make_core(kv_managers) -> Callable[..., EngineCore]:
    """EngineCores over a FakeRunner (unless given), built by the engine's builder."""
    def build(runner: FakeRunner | None = None, **cfg) -> EngineCore:
        core = build_engine_core(engine_config(**cfg), runner or FakeRunner())
        kv_managers.append(core.kv)
        return core
    return build


@pytest.fixture
def make_harness(kv_managers) -> Callable[..., SchedulerHarness]:
    def build(*, num_blocks: int = 64, block_size: int = 4, caching: bool = True,
              max_model_len: int = 256, script=None, **sched_cfg) -> SchedulerHarness:
        sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, caching=caching,
                               max_model_len=max_model_len, **sched_cfg)
        kv_managers.append(sched.kv)
        return SchedulerHarness(sched.kv, sched, FakeRunner(block_size=block_size, script=script,
                                                            max_model_len=max_model_len))
    return build


@pytest.fixture
async def start_engine(request, kv_managers):
    """Start AsyncEngines (FakeRunner unless given); at teardown each must
    have every block free before it is closed (closing aborts everything)."""
    from kvstrata.enginecore.async_engine import AsyncEngine

    engines = []

    async def start(runner: FakeRunner | None = None, connector=None, **cfg) -> AsyncEngine:
        runner = runner or FakeRunner(block_size=cfg.get("block_size", 4))
        engine = await AsyncEngine.start(engine_config(**cfg), runner=runner, connector=connector)
        engines.append(engine)
        kv_managers.append(engine.core.kv)
        return engine

    yield start
    rep = getattr(request.node, "rep_call", None)
    for engine in engines:
        kv = engine.core.kv
        in_use = kv.num_blocks - 1 - kv.num_free_blocks
        await engine.aclose()
        if rep is not None and rep.passed:
            assert in_use == 0, f"{in_use} KV blocks still in use when the test ended"
