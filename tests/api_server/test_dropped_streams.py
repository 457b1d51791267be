"""A client that drops its stream costs one debug line (no traceback, nothing
at warning or above), its request is aborted, every block freed, and it is
counted once as ``client_disconnected``: mid-stream, before the first chunk,
or before the headers could be written."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from unittest import mock

import pytest
from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request
from http_helpers import PacedRunner
from structlog.testing import capture_logs

from kvstrata.api_server.metrics import render_metrics
from kvstrata.api_server.server import OpenAIServer, _json_errors, run_http_server
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


@pytest.fixture
async def slow_first_token():
    """A server whose engine takes half a second per step: a client can leave before the first token."""
    config = EngineConfig(executor="null", device="cpu", log_level="WARNING")
    engine = await AsyncEngine.start(config, runner=PacedRunner(config.model, config.cache, step_s=0.5))
    server = OpenAIServer(engine, model_name="tiny")
    port = free_port()
    runner = await run_http_server(server, "127.0.0.1", port)
    try:
        yield server, port
    finally:
        await runner.cleanup()
        await engine.aclose()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_request_dropped_before_its_first_chunk_is_counted_as_client_disconnected(slow_first_token, stream):
    server, port = slow_first_token
    with capture_logs() as logs:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4, "stream": stream}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        await asyncio.sleep(0.1)  # the request is in the engine, no token yet
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
        for _ in range(200):
            if server.metrics.requests.get("client_disconnected"):
                break
            await asyncio.sleep(0.01)
    assert server.metrics.requests == {"client_disconnected": 1}
    text = render_metrics(await server.engine.stats(), server.metrics, "tiny")
    assert 'kvstrata_http_requests_total{model_name="tiny",outcome="client_disconnected"} 1' in text
    assert [e["log_level"] for e in logs if e["event"] == "client_disconnected"] == ["debug"]
    assert not [e for e in logs if "exc_info" in e or e["log_level"] not in ("debug", "info")], logs


async def test_a_client_gone_before_the_headers_costs_one_debug_line(served):
    """The race the socket test cannot aim at: the first token came, the
    client left, and writing the headers finds the transport closing."""
    engine, _ = served
    server = OpenAIServer(engine, model_name="tiny")
    writer = mock.Mock()
    writer.write_headers = mock.AsyncMock(side_effect=ConnectionResetError("Cannot write to closing transport"))
    payload = StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
    payload.feed_data(json.dumps({"prompt": [1, 2, 3], "max_tokens": 4, "stream": True}).encode())
    payload.feed_eof()
    request = make_mocked_request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                                  writer=writer, payload=payload)
    with capture_logs() as logs:
        await _json_errors(request, server.completions)
    assert server.metrics.requests == {"client_disconnected": 1}
    assert [e["log_level"] for e in logs if e["event"] == "client_disconnected"] == ["debug"]
    assert not [e for e in logs if "exc_info" in e or e["log_level"] not in ("debug", "info")], logs
    for _ in range(100):  # the request was aborted
        if (await engine.stats()).num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert (await engine.stats()).num_running == 0
