"""`kvstrata serve` as a user runs it: a process, flags and env for the
config, the engine subprocess behind it, SIGTERM to stop."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import aiohttp

from serve_process import wait_healthy

from kvstrata.ipc.addresses import free_port


async def test_serve_cli_answers_then_stops_on_sigterm():
    port = free_port()
    env = {**os.environ, "KVSTRATA_EXECUTOR": "null", "KVSTRATA_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "kvstrata", "serve", "--port", str(port),
                             "--served-model-name", "m", "--scheduler.max-num-seqs", "8"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as session:
            await wait_healthy(session, proc)
            async with session.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}) as r:
                body = await r.json()
            assert body["model"] == "m" and body["usage"]["completion_tokens"] == 3
            async with session.get("/metrics") as r:
                assert 'kvstrata_prefix_cache_hit_rate{model_name="m",tier="device"}' in await r.text()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 30)
        assert code == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
