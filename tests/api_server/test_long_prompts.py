"""A long prompt does not stall the server. While long prompts are being
tokenized (completions, chat and blend, through a real byte-level BPE
tokenizer), a prompt longer than the context can hold and a 16 MiB body are
in flight, a neighbour's stream keeps its inter-token latency, and /health
its latency, within 1.5x of idle (measured ~1.0-1.1x on an idle host; a
host loaded by other work moved the ratio up to 1.26, and 1.5 stays far
below what a blocked loop gives: 3x and more for the stream, tens of times
for /health).

Robust on a busy host: idle and loaded phases alternate (idle, load, idle,
..., idle), each loaded phase is compared with the idle phases around it,
and the check is on the median of those ratios; the neighbour's engine
steps are paced (a null runner that sleeps per step), so its inter-token
latency is the step plus whatever holds the server's loop; the load comes
from another process at the lowest CPU priority (its clients share no GIL
with the server, and take as little of its CPU as they can). Tokenizing
on the loop (or in a thread that keeps the GIL, as ``encode`` does) holds it
for a tenth of a second and more per prompt, and seconds for the prompt past
the bound, and fails both checks many times over."""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from http_helpers import PacedRunner, ServerThread, text_of, write_bpe_checkpoint

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig
from kvstrata.enginecore import AsyncEngine

STEP_S = 0.05  # the neighbour's pace
PHASE_S = 1.0
ROUNDS = 4  # loaded phases (each between two idle ones)
MAX_MODEL_LEN = 16384
LONG_CHARS = 150_000  # within the character bound: tokenized (~0.1 s), then too many tokens (400)
OVER_CHARS = 1_000_000  # past the character bound: refused before tokenizing
BODY_BYTES = 16 * 1024 * 1024  # the server's limit

# The load, in its own process: long prompts back to back on one connection
# at a time, and once the prompt past the bound and the 16 MiB body; one
# status per line.
_LOADER = r"""
import http.client, os, sys, threading
os.nice(19)  # a remote client would take none of the server's CPU: this one takes what is left
port, paths = int(sys.argv[1]), sys.argv[2:]
def post(path, file):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, body=open(file, "rb").read(), headers={"Content-Type": "application/json"})
    r = conn.getresponse(); r.read(); conn.close()
    print(r.status, flush=True)
def once():
    for spec in paths[3:]:
        post(*spec.split("=", 1))
threading.Thread(target=once, daemon=True).start()
i = 0
while True:
    post(*paths[i % 3].split("=", 1)); i += 1
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = write_bpe_checkpoint(tmp_path_factory.mktemp("bpe"))
    config = EngineConfig(executor="null", device="cpu", log_level="WARNING",
                          model=ModelConfig(model=str(ckpt), max_model_len=MAX_MODEL_LEN),
                          cache=CacheConfig(block_size=16, num_blocks=MAX_MODEL_LEN // 16 + 64))

    async def make_engine():
        return await AsyncEngine.start(config, runner=PacedRunner(config.model, config.cache, step_s=STEP_S))

    s = ServerThread().start(make_engine, model_name="bpe")
    yield s
    s.stop()


def write_bodies(d: Path) -> list[str]:
    """The loader's ``path=file`` arguments: three long prompts, then the two big bodies."""
    long = text_of(LONG_CHARS)
    sep = "\n##\n"
    passages = sep.join(long[i:i + 5000] for i in range(0, LONG_CHARS, 5000))
    head = json.dumps({"prompt": "hello", "max_tokens": 1, "pad": ""}).encode()
    bodies = [
        ("/v1/completions", json.dumps({"prompt": long, "max_tokens": 1}).encode()),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": long}],
                                             "max_tokens": 1}).encode()),
        ("/v1/completions", json.dumps({"prompt": "head" + sep + passages + sep + "q", "max_tokens": 1,
                                        "blend": {"separator": sep}}).encode()),
        ("/v1/completions", json.dumps({"prompt": "ab|" * (OVER_CHARS // 3), "max_tokens": 2}).encode()),
        ("/v1/completions", head[:-2] + b"x" * (BODY_BYTES - len(head)) + head[-2:]),  # a padded 16 MiB body
    ]
    args = []
    for i, (path, body) in enumerate(bodies):
        (d / f"{i}.json").write_bytes(body)
        args.append(f"{path}={d / f'{i}.json'}")
    return args


async def _measure(session: aiohttp.ClientSession, tokens: list[float]) -> tuple[float, float]:
    """(the neighbour's mean inter-token latency, the median /health latency) over a phase."""
    start = time.perf_counter()
    first = len(tokens)
    health: list[float] = []
    while time.perf_counter() - start < PHASE_S:
        t0 = time.perf_counter()
        async with session.get("/health") as r:
            assert r.status == 200
            await r.read()
        health.append(time.perf_counter() - t0)
        await asyncio.sleep(0.01)
    window = [t for t in tokens[first:] if t >= start]
    assert len(window) >= 5, "the neighbour's stream stopped"
    return (window[-1] - window[0]) / (len(window) - 1), statistics.median(health)


async def test_long_prompts_leave_neighbours_and_health_within_1_5x_of_idle(server, tmp_path):
    loader_args = [sys.executable, "-c", _LOADER, str(server.port), *write_bodies(tmp_path)]
    tokens: list[float] = []
    statuses: list[int] = []
    idle, loaded = [], []
    async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{server.port}") as session:

        async def neighbour() -> None:
            body = {"prompt": [5, 6, 7], "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "stream": True}
            async with session.post("/v1/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        tokens.append(time.perf_counter())

        stream = asyncio.create_task(neighbour())
        try:
            await asyncio.sleep(0.3)  # the stream is flowing
            idle.append(await _measure(session, tokens))
            for _ in range(ROUNDS):
                load = subprocess.Popen(loader_args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                try:
                    loaded.append(await _measure(session, tokens))
                finally:
                    load.kill()
                    out, _ = await asyncio.to_thread(load.communicate)
                statuses += [int(x) for x in out.split()]
                idle.append(await _measure(session, tokens))
            assert not stream.done(), stream
        finally:
            stream.cancel()
    ratios = [[m[k] / ((a[k] + b[k]) / 2) for m, a, b in zip(loaded, idle, idle[1:])] for k in (0, 1)]
    itl, health = (statistics.median(r) for r in ratios)
    report = {"itl_ratio": round(itl, 3), "health_ratio": round(health, 3),
              "itl_ms": [round(m[0] * 1e3, 1) for m in idle + loaded],
              "health_ms": [round(m[1] * 1e3, 2) for m in idle + loaded], "statuses": statuses}
    print(report)
    # The load happened: long prompts tokenized then refused (too many tokens),
    # the prompt past the bound refused at once, the 16 MiB body served.
    assert statuses.count(400) >= 2 * ROUNDS and set(statuses) <= {200, 400}, report
    assert itl <= 1.5, report
    assert health <= 1.5, report
