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
from serve_process import wait_healthy

from kvstrata.ipc.addresses import free_port


async def test_serve_without_a_model_answers_paris(smollm2_gguf):
    port = free_port()
    env = {**os.environ, "KVSTRATA_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "kvstrata", "serve", "--port", str(port),
                             "--cache.num-blocks", "256", "--model.max-model-len", "1024"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as s:
            await wait_healthy(s, proc)
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
