"""``kvstrata serve``: an OpenAI-compatible HTTP server around any
``EngineClient`` (in process, or the multiprocess client).

    POST /v1/completions        POST /v1/chat/completions   (stream: SSE)
    GET  /v1/models             GET  /v1/models/{id}
    GET  /health                GET  /metrics
    GET  /fleet                 (a fleet of replicas: their state and the router's)

A request naming a model this server does not serve is 404
``model_not_found`` (OpenAI's shape). Validation errors are 400 with ``error.param`` naming the field: a body of
the wrong shape here, a value out of range from the engine client's
``RequestError``. An overloaded engine is 503 (retry), a dead one 503 and
/health fails. A client
that disconnects mid-request has its request aborted (handler cancellation is
on, and the generator's close aborts it).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import structlog
from aiohttp import web

from kvstrata.enginecore.client import EngineClient
from kvstrata.errors import EngineDeadError, EngineOverloadedError, RequestError
from kvstrata.text.chat import chat_prompt, chat_text
from kvstrata.types import RequestOutput, SamplingParams
from kvstrata.api_server import openai_types as T
from kvstrata.api_server.metrics import ServerMetrics, render_metrics

log = structlog.get_logger(__name__)
_json = msgspec.json.Encoder()
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}


def _error(status: int, message: str, kind: str, param: str | None = None,
           code: int | str | None = None) -> web.Response:
    body = T.ErrorResponse(T.ErrorBody(message=message, type=kind, param=param,
                                       code=status if code is None else code))
    return web.Response(status=status, body=_json.encode(body), content_type="application/json")


def _model_not_found(name: str) -> web.Response:
    """OpenAI's (and vLLM's) answer for a model this server does not serve."""
    return _error(404, f"The model `{name}` does not exist.", "invalid_request_error", "model",
                  code="model_not_found")


def _chat_prompt(tokenizer: Any, messages: list[T.ChatMessage]) -> str | list[int]:
    """The model's chat template (token ids), or the plain format; bad
    messages (or a template refusing them) are a 400 naming the field."""
    return _rendered(chat_prompt, tokenizer, messages)


def _chat_text(tokenizer: Any, messages: list[T.ChatMessage]) -> tuple[str, bool]:
    """The rendered chat prompt as text (for blend segments found in it)."""
    return _rendered(chat_text, tokenizer, messages)


def _rendered(render: Any, tokenizer: Any, messages: list[T.ChatMessage]) -> Any:
    try:
        return render(tokenizer, messages)
    except ValueError as e:
        msg = str(e)
        param = msg.split(":", 1)[0] if msg.startswith("messages") else "messages"
        raise T.RequestValidationError(msg, param) from None


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error leaves in OpenAI's JSON shape: aiohttp's own (404 route,
    405, 413 body too large) keep their status; anything unexpected is a
    logged 500 (a bug: malformed input must have been a 4xx before)."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return _error(e.status, e.reason or str(e), kind)
    except Exception as e:  # noqa: BLE001 - the last line of defence: never text/plain
        log.exception("request_handler_failed", path=request.path)
        return _error(500, f"internal error: {type(e).__name__}", "server_error")


class OpenAIServer:
    """Owns: the HTTP routes and the server-side metrics. The engine is owned
    by whoever built this server (it closes it). ``model_name`` and
    ``max_model_len`` default to the engine's."""

    def __init__(self, engine: EngineClient, *, model_name: str | None = None, max_model_len: int | None = None,
                 default_max_tokens: int = 16) -> None:
        self.engine = engine
        self.model_name = model_name or engine.model_name
        self.max_model_len = engine.max_model_len if max_model_len is None else max_model_len
        self.default_max_tokens = default_max_tokens
        self.metrics = ServerMetrics()
        self._created = int(time.time())

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024, middlewares=[_json_errors])
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model_id}", self.model),
            web.get("/health", self.health),
            web.get("/metrics", self.prometheus),
            web.get("/fleet", self.fleet),
        ])
        return app

    # --- endpoints ------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            req = T.decode_request(await request.read(), T.CompletionRequest)
            params = T.sampling_params(req, default_max_tokens=self.default_max_tokens)
            prompt = T.completion_prompt(req)
            prompt, params = T.apply_blend(req, prompt, params, self.engine.tokenizer)
        except T.RequestValidationError as e:
            self.metrics.count_request("invalid")
            return _error(400, str(e), "invalid_request_error", e.param)
        if not self._serves(req.model):
            self.metrics.count_request("invalid")
            return _model_not_found(req.model)
        rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        return await self._serve(request, req, prompt, params, rid, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            req = T.decode_request(await request.read(), T.ChatCompletionRequest)
            mt = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            params = T.sampling_params(req, default_max_tokens=self.default_max_tokens, max_tokens=mt)
            if req.blend is not None and req.blend.spans is None:  # segments of the rendered text
                text, special = _chat_text(self.engine.tokenizer, req.messages)
                prompt, params = T.apply_blend(req, text, params, self.engine.tokenizer, add_special=special)
            else:
                prompt = _chat_prompt(self.engine.tokenizer, req.messages)
                prompt, params = T.apply_blend(req, prompt, params, self.engine.tokenizer)
        except T.RequestValidationError as e:
            self.metrics.count_request("invalid")
            return _error(400, str(e), "invalid_request_error", e.param)
        if not self._serves(req.model):
            self.metrics.count_request("invalid")
            return _model_not_found(req.model)
        rid = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        return await self._serve(request, req, prompt, params, rid, chat=True)

    def _serves(self, name: str | None) -> bool:
        """A request may leave ``model`` out; if it names one, it must be ours."""
        return name is None or name == self.model_name

    def _card(self) -> T.ModelCard:
        return T.ModelCard(id=self.model_name, created=self._created, max_model_len=self.max_model_len)

    async def models(self, request: web.Request) -> web.Response:
        return web.Response(body=_json.encode(T.ModelList([self._card()])), content_type="application/json")

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model_id"]
        if name != self.model_name:
            return _model_not_found(name)
        return web.Response(body=_json.encode(self._card()), content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        """200 {"status": "ok"}; 503 while starting, when stalled (work queued,
        no progress for scheduler.stall_timeout_s) or dead."""
        try:
            h = await self.engine.check_health()
        except EngineDeadError as e:
            return _error(503, str(e), "engine_dead")
        if h.healthy:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": h.status, "reason": h.reason,
                                  "seconds_since_progress": round(h.seconds_since_progress, 3),
                                  "num_unfinished": h.num_unfinished}, status=503)

    async def fleet(self, request: web.Request) -> web.Response:
        """The replicas behind this server and the router's view (a fleet
        engine only: ``kvstrata serve --engines N`` or ``--engine ADDR``)."""
        status = getattr(self.engine, "fleet_status", None)
        if status is None:
            return _error(404, "this server runs one engine, not a fleet", "invalid_request_error")
        return web.json_response(status())

    async def prometheus(self, request: web.Request) -> web.Response:
        try:
            stats = await self.engine.stats()
        except EngineDeadError as e:
            return _error(503, str(e), "engine_dead")
        text = render_metrics(stats, self.metrics, self.model_name)
        return web.Response(text=text, content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})

    # --- generation ------------------------------------------------------------------

    async def _serve(self, request: web.Request, req: T.CompletionRequest | T.ChatCompletionRequest,
                     prompt: str | list[int], params: SamplingParams, rid: str, *, chat: bool) -> web.StreamResponse:
        start = time.perf_counter()
        with structlog.contextvars.bound_contextvars(request_id=rid):
            routing = {"session_key": req.user} if req.user and getattr(self.engine, "takes_session_key", False) else {}
            agen = self.engine.generate(prompt, params, request_id=rid, priority=req.priority,
                                        cache_salt=req.cache_salt, **routing)
            try:
                try:
                    first = await anext(agen)  # errors before any byte is sent become 4xx/5xx
                except RequestError as e:
                    self.metrics.count_request("invalid")
                    return _error(400, str(e), "invalid_request_error", e.field)
                except EngineOverloadedError as e:
                    self.metrics.count_request("overloaded")
                    return _error(503, str(e), "overloaded")
                except EngineDeadError as e:
                    self.metrics.count_request("engine_dead")
                    return _error(503, str(e), "engine_dead")
                timer = _Timer(self.metrics, start)
                want_lp = params.logprobs is not None
                if req.stream:
                    return await self._stream(request, req, _chain(first, agen), rid, timer, chat=chat,
                                              logprobs=want_lp)
                try:
                    return await self._complete(_chain(first, agen), rid, timer, chat=chat, logprobs=want_lp)
                except EngineDeadError as e:
                    self.metrics.count_request("engine_dead")
                    return _error(503, str(e), "engine_dead")
            finally:
                await agen.aclose()

    async def _complete(self, outs: AsyncIterator[RequestOutput], rid: str, timer: "_Timer",
                        *, chat: bool, logprobs: bool = False) -> web.Response:
        text: list[str] = []
        lps: list = []
        last: RequestOutput | None = None
        n_out = 0
        async for out in outs:
            timer.output(out)
            text.append(out.text_delta)
            n_out += len(out.new_token_ids)
            if out.logprobs:
                lps.extend(out.logprobs)
            last = out
        assert last is not None and last.finished  # the generator ends with the finished output
        if last.finish_reason == "error":
            return _error(500, last.error or "request failed", "engine_error")
        usage = self._usage(last, n_out)
        timer.finish(last, n_out)
        now = int(time.time())
        tok = self.engine.tokenizer
        if chat:
            lp = T.chat_logprobs(lps, tok) if logprobs else None
            choice = T.ChatChoice(0, T.ChatResponseMessage("assistant", "".join(text)), last.finish_reason, lp)
            body: Any = T.ChatResponse(rid, now, self.model_name, [choice], usage)
        else:
            lp = T.completion_logprobs(lps, tok) if logprobs else None
            body = T.CompletionResponse(rid, now, self.model_name,
                                        [T.CompletionChoice(0, "".join(text), last.finish_reason, lp)], usage)
        return web.Response(body=_json.encode(body), content_type="application/json")

    async def _stream(self, request: web.Request, req: T.CompletionRequest | T.ChatCompletionRequest,
                      outs: AsyncIterator[RequestOutput], rid: str,
                      timer: "_Timer", *, chat: bool, logprobs: bool = False) -> web.StreamResponse:
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        now = int(time.time())
        model = self.model_name
        tok = self.engine.tokenizer
        text_offset = 0
        n_out = 0
        if chat:
            await resp.write(_sse(T.ChatChunk(rid, now, model, [T.ChatStreamChoice(0, T.ChatResponseMessage("assistant", ""))])))
        last: RequestOutput | None = None
        try:
            async for out in outs:
                timer.output(out)
                n_out += len(out.new_token_ids)
                last = out
                # Every output that carries tokens gets a chunk, even with no
                # text yet (a partial UTF-8 sequence): the first chunk leaves
                # as soon as the first token exists, as OpenAI and vLLM do.
                if not out.new_token_ids and not out.text_delta and not out.finished:
                    continue
                fr = out.finish_reason if out.finished else None
                lps = out.logprobs or [] if logprobs else None
                if chat:
                    lp = None if lps is None else T.chat_logprobs(lps, tok)
                    chunk: Any = T.ChatChunk(rid, now, model, [T.ChatStreamChoice(
                        0, T.ChatResponseMessage(content=out.text_delta), fr, lp)])
                else:
                    lp = None if lps is None else T.completion_logprobs(lps, tok, text_offset)
                    text_offset += len(out.text_delta)
                    chunk = T.CompletionResponse(rid, now, model, [T.CompletionChoice(0, out.text_delta, fr, lp)])
                await resp.write(_sse(chunk))
        except ConnectionError:  # the client went away mid-write: one quiet line
            self._disconnected(n_out)
            return resp  # _serve closes the generator: that aborts the request
        except asyncio.CancelledError:  # aiohttp cancels the handler of a closed connection
            transport = request.transport
            if transport is None or transport.is_closing():
                self._disconnected(n_out)
            raise
        except EngineDeadError as e:  # headers are sent: report in-band, then end the stream
            self.metrics.count_request("engine_dead")
            await resp.write(_sse(T.ErrorResponse(T.ErrorBody(message=str(e), type="engine_dead", code=503))))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        assert last is not None and last.finished
        timer.finish(last, n_out)
        if req.stream_options is not None and req.stream_options.include_usage:
            usage = self._usage(last, n_out)
            tail: Any = (T.ChatChunk(rid, now, model, [], usage) if chat
                         else T.CompletionResponse(rid, now, model, [], usage))
            await resp.write(_sse(tail))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _disconnected(self, n_out: int) -> None:
        self.metrics.count_request("disconnected")
        log.debug("client_disconnected", tokens_sent=n_out)

    def _usage(self, last: RequestOutput, n_out: int) -> T.Usage:
        p = last.num_prompt_tokens
        return T.Usage(p, n_out, p + n_out, T.PromptTokensDetails(last.num_cached_tokens))


class _Timer:
    """Per-request latency bookkeeping for the server histograms."""

    __slots__ = ("m", "start", "last")

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self.m = metrics
        self.start = start
        self.last: float | None = None

    def output(self, out: RequestOutput) -> None:
        if not out.new_token_ids:
            return
        now = time.perf_counter()
        if self.last is None:
            self.m.ttft.observe(now - self.start)
        else:
            self.m.itl.observe(now - self.last)
        self.last = now

    def finish(self, last: RequestOutput, n_out: int) -> None:
        self.m.e2e.observe(time.perf_counter() - self.start)
        self.m.count_request(last.finish_reason or "unknown")
        self.m.prompt_tokens += last.num_prompt_tokens
        self.m.generation_tokens += n_out


async def _chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    if first.finished:
        return
    async for out in rest:
        yield out


def _sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


DEFAULT_BACKLOG = 2048


async def run_http_server(server: OpenAIServer, host: str, port: int, *,
                          backlog: int = DEFAULT_BACKLOG) -> web.AppRunner:
    """Start listening; the caller awaits its own stop signal then ``runner.cleanup()``.

    ``backlog``: the listen queue for connections not yet accepted (a burst of
    a thousand clients connecting at once must not wait on SYN retries; the
    kernel caps it at net.core.somaxconn)."""
    if backlog < 1:
        raise ValueError(f"backlog must be >= 1, got {backlog}")
    runner = web.AppRunner(server.make_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=backlog)
    await site.start()
    log.info("http_server_listening", host=host, port=port, model=server.model_name, backlog=backlog)
    return runner
