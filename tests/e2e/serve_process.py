"""Helpers for the tests that run `kvstrata serve` as a process."""

from __future__ import annotations

import asyncio
import subprocess

import aiohttp


async def wait_healthy(session: aiohttp.ClientSession, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Poll /health until 200; the process must not exit meanwhile."""
    async with asyncio.timeout(timeout_s):
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode()[-3000:] if proc.stderr else ""
                raise AssertionError(f"kvstrata serve exited early: {err}")
            try:
                async with session.get("/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.1)
