"""The engine subprocess gets its config (which may hold a Redis password)
through a pipe: no secret in any process's argv (``ps``,
``/proc/PID/cmdline``), nor in its logs; the password still reaches the
tier (the engine stores and reloads KV through the password-protected Redis)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from kvstrata.config import CacheConfig, EngineConfig, KVTransferConfig
from kvstrata.ipc.mp_client import MPEngineClient
from kvstrata.types import SamplingParams

SECRET = "hunter2-s3cr3t-Zq81"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_with_password(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("KVSTRATA_REQUIRE_REDIS") == "1":
            raise RuntimeError("redis-server not found and KVSTRATA_REQUIRE_REDIS=1")
        pytest.skip("redis-server not installed")
    port = _free_port()
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path), "--requirepass", SECRET],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield port
    proc.kill()
    proc.wait()


def _cmdlines() -> dict[int, bytes]:
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                out[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                pass
    return out


@pytest.mark.timeout(240)
async def test_no_process_shows_the_redis_password_and_the_tier_still_gets_it(redis_with_password, capfd):
    port = redis_with_password
    kv = KVTransferConfig(connector="offload", options={
        "chunk_size": 16,
        "store": {"cpu": {"capacity_bytes": 1 << 22},
                  "tiers": [{"type": "redis", "name": "redis",
                             "options": {"host": "127.0.0.1", "port": port, "password": SECRET}}]},
    })
    config = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64), kv_transfer=kv, log_level="INFO")
    async with await MPEngineClient.start(config) as engine:
        engines = {pid: c for pid, c in _cmdlines().items() if b"kvstrata.ipc.engine_proc" in c}
        assert engines, "the engine subprocess is running"
        assert not [pid for pid, c in _cmdlines().items() if SECRET.encode() in c]
        prompt = list(range(1, 70))
        params = SamplingParams(max_tokens=2, temperature=0)
        first = [o async for o in engine.generate(prompt, params)]
        deadline = time.monotonic() + 30
        while True:  # saves reach Redis asynchronously
            stats = await engine.stats()
            if stats.extra.get("store.redis.bytes_in", 0) > 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert stats.extra.get("store.redis.available") == 1.0
        assert stats.extra.get("store.redis.bytes_in", 0) > 0  # authenticated writes landed
        assert first[-1].finished
    out, err = capfd.readouterr()
    assert SECRET not in out and SECRET not in err
