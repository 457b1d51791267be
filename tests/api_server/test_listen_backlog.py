"""The HTTP listen backlog is configurable, 2048 by default (it was aiohttp's
128, which queued a burst of 1,024 clients behind SYN retries)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from kvstrata.api_server.server import OpenAIServer, run_http_server
from kvstrata.cli.main import build_parser
from kvstrata.config import EngineConfig
from kvstrata.enginecore import AsyncEngine
from kvstrata.ipc.addresses import free_port

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read the backlog")


def listen_backlog(port: int) -> int:
    """Send-Q of a listening socket is its backlog (Linux ss)."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return int(out.split()[2])


def somaxconn() -> int:
    with open("/proc/sys/net/core/somaxconn") as f:
        return int(f.read())


@pytest.mark.parametrize("backlog", [None, 1500])
async def test_the_listening_socket_has_the_configured_backlog(backlog):
    engine = await AsyncEngine.start(EngineConfig(executor="null", device="cpu", log_level="WARNING"))
    port = free_port()
    kw = {} if backlog is None else {"backlog": backlog}
    runner = await run_http_server(OpenAIServer(engine), "127.0.0.1", port, **kw)
    try:
        assert listen_backlog(port) == min(backlog or 2048, somaxconn())
    finally:
        await runner.cleanup()
        await engine.aclose()


def test_serve_cli_takes_a_backlog():
    parser = build_parser()
    assert parser.parse_args(["serve"]).backlog == 2048
    assert parser.parse_args(["serve", "--backlog", "4096"]).backlog == 4096
