"""`kvstrata serve --engines N` on a CPU host: the engines divide the cores
(issue 24 §5): N engines at torch's default thread count each oversubscribe
the CPU (2 engines on 2 cores served 10x slower than one)."""

from __future__ import annotations

import argparse
import os

import msgspec
import pytest

from kvstrata.cli.commands import engines_config, open_fleet
from kvstrata.config import EngineConfig, ModelConfig, SchedulerConfig


def _config(**model) -> EngineConfig:
    return EngineConfig(executor="null", device="cpu", log_level="WARNING", model=ModelConfig(**model),
                        scheduler=SchedulerConfig())


@pytest.mark.parametrize(("cores", "engines", "threads"), [(2, 2, 1), (16, 3, 5), (2, 4, 1), (8, 2, 4)])
def test_engines_on_a_cpu_host_divide_its_cores(cores, engines, threads):
    assert engines_config(_config(), engines, cores=cores, on_cpu=True).model.num_threads == threads


def test_an_explicit_thread_count_one_engine_or_a_gpu_keep_the_config():
    explicit = _config(num_threads=3)
    assert engines_config(explicit, 2, cores=16, on_cpu=True) is explicit
    plain = _config()
    assert engines_config(plain, 1, cores=16, on_cpu=True) is plain
    assert engines_config(plain, 2, cores=16, on_cpu=False) is plain
    gpu = msgspec.structs.replace(plain, device="cuda")
    assert engines_config(gpu, 2, cores=16) is gpu  # decided without asking torch


async def test_serve_engines_2_starts_engines_with_their_share_of_the_cores():
    args = argparse.Namespace(engines=2, engine_address=None, engine=[], registry=None, credentials=None,
                              transport="ipc", router_policy="kv", router_affinity=2,
                              router_shared_fanout=2)
    fleet = await open_fleet(args, _config())
    try:
        cores = len(os.sched_getaffinity(0))
        # the config each engine's handshake reports: what the engine runs with
        for replica in fleet.replicas.values():
            assert replica.client.config.model.num_threads == max(1, cores // 2)
    finally:
        await fleet.aclose()
