"""Shared builders for the connector tests: tiny HF Llama checkpoints (the
oracle), offload-connector configs over real tiers, a real redis-server,
and a connector class loadable by dotted path.

(A module of its own, not conftest.py: test modules import these names.)
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "enginecore"))

from hf_utils import build_tiny_llama, hf_greedy  # noqa: E402

from kvstrata.connector import KVTransferConfig, NoOpConnectorScheduler, NoOpConnectorWorker  # noqa: E402
from kvstrata.enginecore import EngineRequest, SamplingParams  # noqa: E402

REDIS_BIN = shutil.which("redis-server") or "/usr/bin/redis-server"
BLOCK = 4
CHUNK = 16
N = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=N)
__all__ = ["build_tiny_llama", "hf_greedy"]


class Oracle:
    """The tiny checkpoint and HF greedy continuations, memoized."""

    def __init__(self, path: str, model) -> None:
        self.path = path
        self.model = model
        self._memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self._memo:
            self._memo[key] = hf_greedy(self.model, prompt, n)
        return self._memo[key]


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 256) for _ in range(n)]


def add(core, rid: str, p: list[int]) -> None:
    """Queue a greedy request of ``N`` tokens on an EngineCore."""
    core.add_request(EngineRequest(request_id=rid, prompt_token_ids=p, sampling_params=GREEDY))


async def step(core, outputs: dict[str, list[int]]):
    """One engine step, then let the connector's tasks run."""
    so = core.schedule()
    out = core.execute(so) if core.should_execute(so) else None
    if out is not None:
        for o in core.update(so, out):
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    for _ in range(3):
        await asyncio.sleep(0)
    return so


async def run_until_idle(core, outputs, max_steps=200) -> None:
    for _ in range(max_steps):
        if not core.has_work():
            return
        await step(core, outputs)
        await asyncio.sleep(0.001)
    raise AssertionError("the engine did not go idle")


async def seed_lower_tiers(core, p: list[int], outputs: dict[str, list[int]]) -> None:
    """Compute ``p`` once (request "seed"), let its chunks reach every tier,
    then forget them on the device and in L1: only the lower tiers keep them."""
    add(core, "seed", p)
    await run_until_idle(core, outputs)
    await core.kv_connector.flush()
    assert core.reset_prefix_cache()
    core.kv_connector.store.l1.clear()


def assert_stepped(engine, stepping: dict[str, bool]) -> None:
    """``engine`` stepped as ``stepping`` asked (the ``stepping`` fixture):
    with async scheduling, kept on with a connector attached, steps were
    scheduled while the one before them ran; serially, none was."""
    overlapped = stepping["async_scheduling"]
    assert engine.async_scheduling is overlapped
    assert (engine.num_overlapped_steps > 0) is overlapped


def fs_tier(path: Path, **kw: Any) -> dict:
    """A shared-filesystem tier: it cannot tell what it holds without I/O (a lookup)."""
    return {"type": "fs", "name": "fs", "options": {"path": str(path), **kw}}


def offload_config(*, cpu_chunks: int = 64, chunk_size: int = CHUNK, tiers: tuple = (), role: str = "both",
                   chunk_bytes: int = 8192, save_partial: bool = False, **opts: Any) -> KVTransferConfig:
    """An offload connector over an L1 of ``cpu_chunks`` chunks (of ``chunk_bytes``) and ``tiers``."""
    store = {"cpu": {"capacity_bytes": max(4096, cpu_chunks * chunk_bytes), "pin_memory": False},
             "tiers": list(tiers), "save_partial_chunks": save_partial, "close_timeout_s": 5.0}
    # Tier mechanics are tested saving every chunk; admission has its own tests.
    opts.setdefault("save_admission", "all")
    return KVTransferConfig(connector="offload", role=role,
                            options={"store": store, "chunk_size": chunk_size, **opts})


def disk_tier(path: Path, *, chunks: int = 256, chunk_bytes: int = 8192, name: str = "disk", **kw: Any) -> dict:
    options = {"path": str(path), "capacity_bytes": chunks * (4096 + chunk_bytes), "use_odirect": False,
               "health": {"retry_interval_s": 0.05, "max_retry_interval_s": 0.1}, **kw}
    return {"type": "disk", "name": name, "options": options}


def redis_tier(port: int, **kw: Any) -> dict:
    options = {"host": "127.0.0.1", "port": port, "socket_timeout_s": 1.0, "connect_timeout_s": 0.5,
               "health": {"retry_interval_s": 0.05, "max_retry_interval_s": 0.2}, **kw}
    return {"type": "redis", "name": "redis", "options": options}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_available() -> bool:
    if os.path.exists(REDIS_BIN):
        return True
    if os.environ.get("KVSTRATA_REQUIRE_REDIS") == "1":
        raise RuntimeError(f"redis-server not found at {REDIS_BIN} and KVSTRATA_REQUIRE_REDIS=1")
    return False


class RedisServer:
    """A redis-server on a free loopback port, no persistence; killed by the fixture."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [REDIS_BIN, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)

    def dbsize(self) -> int:
        """Keys in the server (blocking: call through asyncio.to_thread)."""
        import redis

        with redis.Redis(host="127.0.0.1", port=self.port) as client:
            return client.dbsize()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class RecordingConnector:
    """A third-party-style connector loaded by dotted path in the factory
    tests: both sides do nothing; ``opened`` counts opens."""

    opened = 0

    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config

    @classmethod
    async def open(cls, config: KVTransferConfig, factory: Any = None) -> RecordingConnector:
        cls.opened += 1
        await asyncio.sleep(0)
        return cls(config)

    async def flush(self) -> None:
        return None

    def set_wakeup(self, callback: Any) -> None:
        return None

    def scheduler_side(self, spec: Any) -> NoOpConnectorScheduler:
        return NoOpConnectorScheduler()

    def worker_side(self, spec: Any) -> NoOpConnectorWorker:
        return NoOpConnectorWorker()

    async def aclose(self) -> None:
        return None


class NotAConnector:
    """Lacks the KVConnector members (the factory must refuse it)."""

    @classmethod
    async def open(cls, config: Any, factory: Any = None) -> NotAConnector:
        return cls()
