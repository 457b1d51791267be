"""`kvstrata serve --engines 2` and `kvstrata engine --listen tcp://` as a
user runs them: processes, flags, real sockets, the CURVE key file."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys

import aiohttp

from serve_process import wait_healthy

from kvstrata.ipc.addresses import free_port

TINY = ["--model", "random", "--cache.block-size", "4", "--cache.num-blocks", "96", "--model.num-threads", "1",
        "--model.max-model-len", "256"]


def _popen(*args: str) -> subprocess.Popen:
    env = {**os.environ, "KVSTRATA_LOG_LEVEL": "WARNING"}
    return subprocess.Popen([sys.executable, "-m", "kvstrata", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


async def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return await asyncio.to_thread(proc.wait, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


async def _complete(session: aiohttp.ClientSession, prompt: list[int], **extra) -> dict:
    async with session.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                                     **extra}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_serve_engines_2_routes_a_conversation_home():
    port = free_port()
    proc = _popen("serve", "--port", str(port), "--engines", "2", *TINY)
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as session:
            await wait_healthy(session, proc)
            prompt = list(range(1, 33))
            first = await _complete(session, prompt)
            prompt2 = prompt + [5, 6, 7, 8]
            second = await _complete(session, prompt2)
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # routed to its prefix
            assert first["usage"]["completion_tokens"] == 3
            for k in range(6):  # new prefixes spread over both replicas
                await _complete(session, [100 + k] * 20)
            async with session.get("/fleet") as r:
                fleet = await r.json()
            assert {n: v["up"] for n, v in fleet["replicas"].items()} == {"engine-0": True, "engine-1": True}
            routed = fleet["counters"]["routed"]
            assert sum(routed.values()) == 8 and min(routed.values()) >= 1
            async with session.get("/metrics") as r:
                assert r.status == 200
        assert await _stop(proc) == 0
    finally:
        if proc.poll() is None:
            await _stop(proc)


async def test_engine_listen_tcp_with_a_key_file_and_a_router_that_has_it(tmp_path):
    keys = tmp_path / "engine.keys"
    eport, sport = free_port(), free_port()
    engine = _popen("engine", "--listen", f"tcp://127.0.0.1:{eport}", "--credentials", str(keys), *TINY)
    serve = None
    try:
        async with asyncio.timeout(60):
            while not keys.exists():
                assert engine.poll() is None, engine.stderr.read().decode()[-2000:]
                await asyncio.sleep(0.05)
        assert stat.S_IMODE(keys.stat().st_mode) == 0o600
        # a router without the key file is refused with a clear error
        bad = _popen("serve", "--port", str(sport), "--engine", f"tcp://127.0.0.1:{eport}")
        assert await asyncio.to_thread(bad.wait, 60) == 2
        assert b"--credentials" in bad.stderr.read()
        bad.stderr.close()
        # with it (and one unreachable engine beside): serves with the one it has
        dead = free_port()
        serve = _popen("serve", "--port", str(sport), "--engine", f"tcp://127.0.0.1:{eport}",
                       "--engine", f"tcp://127.0.0.1:{dead}", "--credentials", str(keys))
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{sport}") as session:
            await wait_healthy(session, serve)
            assert (await _complete(session, [1, 2, 3, 4, 5]))["usage"]["completion_tokens"] == 3
            async with session.get("/fleet") as r:
                reps = (await r.json())["replicas"]
            assert reps[f"tcp://127.0.0.1:{eport}"]["up"] and not reps[f"tcp://127.0.0.1:{dead}"]["up"]
        assert await _stop(serve) == 0
        assert await _stop(engine) == 0
    finally:
        for p in (serve, engine):
            if p is not None and p.poll() is None:
                await _stop(p)
