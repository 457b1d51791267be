"""Where the load goes: an ``EngineClient`` (in-process AsyncEngine or the
ZMQ client) or an OpenAI-compatible HTTP server (SSE streaming); both are
``LoadTarget``s.

A target turns one prompt into a ``RequestRecord``: timestamps of every
output chunk that carried tokens, token counts, cached prompt tokens.
"""

from __future__ import annotations

import time
from typing import Protocol

import aiohttp
import msgspec

from kvstrata.enginecore.client import EngineClient
from kvstrata.types import EngineStats, SamplingParams
from kvstrata.api_server.metrics import stats_from_metrics


class RequestRecord(msgspec.Struct, kw_only=True):
    """One request as the client saw it (times in seconds, perf_counter)."""

    conv_id: str
    turn: int
    start: float
    first_token: float | None = None
    end: float = 0.0
    chunk_times: list[float] = []   # arrival of every output that carried tokens
    chunk_tokens: list[int] = []    # tokens in each of those outputs
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    user: str = ""   # the turn's user message (the prompt's new part)
    reply: str = ""  # what the model answered


class LoadTarget(Protocol):
    """What the load driver sends requests to."""

    name: str

    async def request(self, prompt: str, params: SamplingParams, rec: RequestRecord) -> str:
        """Run one request, filling ``rec``; returns the reply's text. Never raises for a failed request."""
        ...

    async def stats(self) -> EngineStats | None: ...

    async def aclose(self) -> None: ...


class EngineTarget:
    """Drives an ``EngineClient``. Owns: nothing (the engine is the caller's)."""

    def __init__(self, engine: EngineClient, name: str) -> None:
        self.engine = engine
        self.name = name

    async def request(self, prompt: str, params: SamplingParams, rec: RequestRecord) -> str:
        text: list[str] = []
        now = time.perf_counter
        times, counts = rec.chunk_times, rec.chunk_tokens
        try:
            async for out in self.engine.generate(prompt, params):
                n = len(out.new_token_ids)
                if n:
                    t = now()
                    times.append(t)
                    counts.append(n)
                if out.text_delta:
                    text.append(out.text_delta)
                if out.finished:
                    rec.prompt_tokens = out.num_prompt_tokens
                    rec.cached_tokens = out.num_cached_tokens
                    rec.finish_reason = out.finish_reason
                    rec.error = out.error
        except (ValueError, RuntimeError) as e:  # RequestError, overloaded, dead
            rec.error = f"{type(e).__name__}: {e}"
        _close_record(rec, now())
        return "".join(text)

    async def stats(self) -> EngineStats | None:
        return await self.engine.stats()

    async def aclose(self) -> None:
        return None


class HttpTarget:
    """Drives ``/v1/completions`` with ``stream=true`` and usage in the last
    chunk. Owns: its aiohttp session."""

    def __init__(self, base_url: str, model: str | None = None, *, connections: int = 0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = "http"
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections), timeout=aiohttp.ClientTimeout(total=None))
        self._decoder = msgspec.json.Decoder(_Chunk)

    async def request(self, prompt: str, params: SamplingParams, rec: RequestRecord) -> str:
        body = {"prompt": prompt, "stream": True, "stream_options": {"include_usage": True},
                **msgspec.to_builtins(params)}
        if self.model:
            body["model"] = self.model
        text: list[str] = []
        try:
            async with self._session.post(f"{self.base_url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                else:
                    await self._read_sse(resp, rec, text)
        except aiohttp.ClientError as e:
            rec.error = f"{type(e).__name__}: {e}"
        _close_record(rec, time.perf_counter())
        return "".join(text)

    async def _read_sse(self, resp: aiohttp.ClientResponse, rec: RequestRecord, text: list[str]) -> None:
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            chunk = self._decoder.decode(data)
            for choice in chunk.choices:
                if choice.text:
                    rec.chunk_times.append(time.perf_counter())
                    rec.chunk_tokens.append(1)  # corrected from usage below
                    text.append(choice.text)
                if choice.finish_reason:
                    rec.finish_reason = choice.finish_reason
            if chunk.usage is not None:
                rec.prompt_tokens = chunk.usage.prompt_tokens
                rec.output_tokens = chunk.usage.completion_tokens
                if chunk.usage.prompt_tokens_details is not None:
                    rec.cached_tokens = chunk.usage.prompt_tokens_details.cached_tokens

    async def stats(self) -> EngineStats | None:
        async with self._session.get(f"{self.base_url}/metrics") as resp:
            if resp.status != 200:
                return None
            return stats_from_metrics(await resp.text())

    async def aclose(self) -> None:
        await self._session.close()


def _close_record(rec: RequestRecord, end: float) -> None:
    rec.end = end
    if rec.chunk_times:
        rec.first_token = rec.chunk_times[0]
    if rec.output_tokens == 0:
        rec.output_tokens = sum(rec.chunk_tokens)


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: "_Details | None" = None


class _Details(msgspec.Struct):
    cached_tokens: int = 0


class _Choice(msgspec.Struct):
    text: str = ""
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
