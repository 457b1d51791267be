"""Shared builders for the serve tests: a real engine subprocess (null
executor: tokens at no cost, so the tests measure the transport, not a model)."""

from __future__ import annotations

import signal
import subprocess

import pytest

from kvstrata.config import EngineConfig, SchedulerConfig
from kvstrata.ipc.addresses import make_address
from kvstrata.ipc.launcher import spawn_engine
from kvstrata.ipc.protocol import Credentials

TEST_MAX_FRAME_BYTES = 64 * 1024


def null_config(**scheduler: int) -> EngineConfig:
    return EngineConfig(executor="null", device="cpu", log_level="WARNING",
                        scheduler=SchedulerConfig(**scheduler))


@pytest.fixture(scope="module")
def engine_url():
    """One engine subprocess for a test module; each test connects its own clients."""
    addr = make_address("ipc")
    proc = spawn_engine(null_config(), addr.url, Credentials.new(curve=False), max_frame_bytes=TEST_MAX_FRAME_BYTES)
    try:
        yield addr.url
    finally:
        _stop(proc)
        addr.cleanup()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
