"""Builders shared by the fleet tests that run real engine subprocesses
at fixed ipc addresses (so a test can kill one with SIGKILL, and restart it
at the same address)."""

from __future__ import annotations

import os
import signal
import subprocess

from kvstrata.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from kvstrata.fleet import FleetClient, Replica, remote_connector
from kvstrata.ipc.addresses import make_address
from kvstrata.ipc.launcher import spawn_engine
from kvstrata.ipc.protocol import Credentials
from kvstrata.router import RouterConfig


def tiny_config(*, num_blocks: int = 64, cpu_store: bool = False) -> EngineConfig:
    """The seeded tiny model on 4-token blocks, KV events on (the router
    needs them); with ``cpu_store`` the offload connector over a CPU tier."""
    kvt = KVTransferConfig()
    if cpu_store:
        kvt = KVTransferConfig(connector="offload", options={
            "store": {"cpu": {"capacity_bytes": 1 << 20, "pin_memory": False}}, "chunk_size": 8})
    return EngineConfig(device="cpu", log_level="WARNING", model=ModelConfig(num_threads=1, max_model_len=128),
                        kv_transfer=kvt, cache=CacheConfig(block_size=4, num_blocks=num_blocks,
                                                           enable_kv_events=True))


class Engines:
    """Engine subprocesses at fixed ipc addresses (restartable at the same one)."""

    def __init__(self, config: EngineConfig, n: int) -> None:
        self.config = config
        self.addrs = [make_address("ipc") for _ in range(n)]
        self.procs: list[subprocess.Popen | None] = [None] * n
        for i in range(n):
            self.start(i)

    def start(self, i: int) -> None:
        # A killed engine's socket directory looks stale to any make_address
        # (this host's other test runs too), which removes it: make it again.
        if self.addrs[i].private_dir is not None:
            os.makedirs(self.addrs[i].private_dir, mode=0o700, exist_ok=True)
        self.procs[i] = spawn_engine(self.config, self.addrs[i].url, Credentials.new(curve=False))

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def url(self, i: int) -> str:
        return self.addrs[i].url

    def close(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.terminate()
        for p in self.procs:
            if p is not None:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        for a in self.addrs:
            a.cleanup()


async def open_fleet(engines: Engines, policy: str = "kv", **kwargs) -> FleetClient:
    replicas = [Replica(f"r{i}", "remote", remote_connector(engines.url(i), timeout_s=60.0), address=engines.url(i))
                for i in range(len(engines.addrs))]
    return await FleetClient.start(replicas, RouterConfig(policy=policy, load_skip_min_tokens=10_000),
                                   retry_interval_s=0.2, grace_s=60.0, **kwargs)
