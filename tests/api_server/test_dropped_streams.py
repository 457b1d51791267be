"""A client that drops its stream costs one debug line (no traceback, nothing
at warning or above) and its request is aborted, every block freed."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct

import pytest
import structlog
from structlog.testing import capture_logs

from kvstrata.api_server.server import OpenAIServer, run_http_server
from kvstrata.config import EngineConfig
from kvstrata.enginecore import AsyncEngine
from kvstrata.ipc.addresses import free_port


@pytest.fixture
async def served():
    engine = await AsyncEngine.start(EngineConfig(executor="null", device="cpu", log_level="WARNING"))
    port = free_port()
    runner = await run_http_server(OpenAIServer(engine, model_name="tiny"), "127.0.0.1", port)
    try:
        yield engine, port
    finally:
        await runner.cleanup()
        await engine.aclose()


async def _open_stream_and_drop(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 8000, "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    seen = b""
    while b"data: " not in seen:  # the headers, then the first chunk
        seen += await reader.read(4096)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, as a killed client
    writer.close()


async def test_dropped_streams_log_one_debug_line_and_free_everything(served, caplog):
    engine, port = served
    caplog.set_level(logging.DEBUG)
    with capture_logs() as logs:
        for _ in range(5):
            await _open_stream_and_drop(port)
        for _ in range(500):
            s = await engine.stats()
            if s.num_running == 0 and s.num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # let the handlers finish their logging
    s = await engine.stats()
    assert s.num_running == 0 and s.num_waiting == 0
    assert s.kv_usage == 0.0  # every block back in the pool
    loud = [e for e in logs if e.get("log_level") not in ("debug", "info")]
    assert not loud, loud
    assert not [e for e in logs if "exc_info" in e or "exception" in e], logs
    drops = [e for e in logs if e.get("event") == "client_disconnected"]
    assert len(drops) == 5 and all(e["log_level"] == "debug" for e in drops)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info], \
        [(r.name, r.getMessage()) for r in caplog.records]
