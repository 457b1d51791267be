"""Engine death and shutdown: every pending request of every client fails
fast with EngineDeadError, and nothing hangs."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from kvstrata.errors import EngineDeadError, EngineOverloadedError
from kvstrata.types import SamplingParams
from kvstrata.ipc.mp_client import MPEngineClient
from serve_helpers import null_config

LONG = SamplingParams(max_tokens=8000, ignore_eos=True)


async def _start_streams(client, n, tag):
    gens = [client.generate(f"{tag} {i}", LONG) for i in range(n)]
    for g in gens:
        await anext(g)  # every request is running and streaming

    async def drain(g):
        try:
            async for _ in g:
                pass
        except EngineDeadError as e:
            return e
        return None

    return [asyncio.create_task(drain(g)) for g in gens]


async def test_kill_9_fails_every_clients_pending_requests_within_a_second():
    owner = await MPEngineClient.start(null_config())
    other = await MPEngineClient.connect(owner.address)
    try:
        tasks = await _start_streams(owner, 8, "owner") + await _start_streams(other, 8, "other")
        os.kill(owner.info.pid, signal.SIGKILL)
        async with asyncio.timeout(1.0):  # the bound: fail fast, never hang
            errors = await asyncio.gather(*tasks)
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
        for client in (owner, other):
            with pytest.raises(EngineDeadError):
                await client.stats()
            with pytest.raises(EngineDeadError):
                await anext(client.generate("after", LONG))
            assert client.is_dead
    finally:
        await other.aclose()
        await owner.aclose()


async def test_shutdown_ends_every_client_with_engine_dead():
    owner = await MPEngineClient.start(null_config(), transport="tcp")
    other = await MPEngineClient.connect(owner.address, credentials=owner.credentials.for_client())
    try:
        assert owner.address.startswith("tcp://127.0.0.1:")
        tasks = await _start_streams(other, 4, "x")
        await owner.shutdown_engine()
        async with asyncio.timeout(10):
            errors = await asyncio.gather(*tasks)
        assert all(isinstance(e, EngineDeadError) for e in errors)
        assert "shutdown requested" in str(errors[0])
    finally:
        await other.aclose()
        await owner.aclose()
    assert owner._proc.returncode == 0  # a requested shutdown exits cleanly


async def test_full_waiting_queue_is_overloaded_and_close_is_idempotent():
    client = await MPEngineClient.start(null_config(max_num_seqs=1, max_waiting_requests=1))
    try:
        running = client.generate("a", LONG)
        await anext(running)  # occupies the only running slot
        waiting = client.generate("b", LONG)
        waiting_task = asyncio.create_task(anext(waiting))
        await asyncio.sleep(0)  # let it send its AddRequest before "c" (one socket: order kept)
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests=1"):
            await anext(client.generate("c", LONG))
        await running.aclose()  # frees the slot: the waiting one runs
        first = await asyncio.wait_for(waiting_task, 10)
        assert first.new_token_ids
        await waiting.aclose()
    finally:
        await client.aclose()
        await client.aclose()
    with pytest.raises(EngineDeadError):
        await anext(client.generate("after close", LONG))
