"""`kvstrata serve` with no --model serves the real default model,
SmolLM2-135M-Instruct (fetched into the cache once), with its chat template:
asked the capital of France at temperature 0, it answers Paris."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import aiohttp
import pytest

from kvstrata.ipc.addresses import free_port
from kvstrata.worker.model import CheckpointError
from kvstrata.worker.model.smollm2 import locate_smollm2


async def test_serve_without_a_model_answers_paris():
    try:
        locate_smollm2(download=True)
    except CheckpointError as e:
        pytest.skip(str(e))
    port = free_port()
    env = {**os.environ, "KVSTRATA_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "kvstrata", "serve", "--port", str(port),
                             "--cache.num-blocks", "256", "--model.max-model-len", "1024"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as s:
            for _ in range(600):
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
                try:
                    async with s.get("/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.2)
            async with s.get("/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"
            body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "temperature": 0, "max_tokens": 24}
            async with s.post("/v1/chat/completions", json=body) as r:
                out = await r.json()
            assert "Paris" in out["choices"][0]["message"]["content"], out
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 30)
