"""``kvstrata serve``: an OpenAI-compatible HTTP server around any
``EngineClient`` (in process, the multiprocess client, a fleet).

    POST /v1/completions        POST /v1/chat/completions   (stream: SSE)
    GET  /v1/models             GET  /v1/models/{id}
    POST /tokenize              POST /detokenize            (vLLM's shapes)
    GET  /health                GET  /metrics
    GET  /fleet                 (a fleet of replicas: their state and the router's)

A request is checked cheapest first, and no prompt holds the event loop:

    Content-Type (415 unless JSON) -> body decoded, all of it UTF-8 (400)
    -> ``model`` (404 ``model_not_found``, OpenAI's shape) -> fields (400)
    -> the engine client's one text path (``kvstrata.text.prompts``): bounds
       on characters, messages and segments before tokenizing, long texts
       tokenized in a worker thread without the GIL (400 naming the field)

Validation errors are 400 with ``error.param`` naming the field: a body of
the wrong shape here, a value out of range from the engine client's
``RequestError``. An overloaded engine is 503 (retry), a dead one 503 and
/health fails. A client that disconnects has its request aborted (handler
cancellation is on, and the generator's close aborts it), costs one debug
line, and is counted as ``client_disconnected`` in
``kvstrata_http_requests_total``, before its first chunk or after.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import msgspec
import structlog
from aiohttp import hdrs, web

from kvstrata.enginecore.client import EngineClient
from kvstrata.errors import EngineDeadError, EngineOverloadedError, RequestError
from kvstrata.fleet.client import FleetClient
from kvstrata.text.chat import ChatTokenizer, chat_prompt
from kvstrata.text.prompts import ChatPrompt, Prompt, PromptTokenizer
from kvstrata.types import RequestOutput, SamplingParams
from kvstrata.api_server import openai_types as T
from kvstrata.api_server.metrics import ServerMetrics, render_metrics

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
R = TypeVar("R", bound=msgspec.Struct)  # a request body's type

log = structlog.get_logger(__name__)
_json = msgspec.json.Encoder()
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}
MAX_BODY_BYTES = 16 * 1024 * 1024
DISCONNECTED = "client_disconnected"  # the outcome of a request whose client left


def _error(status: int, message: str, kind: str, param: str | None = None,
           code: int | str | None = None) -> web.Response:
    body = T.ErrorResponse(T.ErrorBody(message=message, type=kind, param=param,
                                       code=status if code is None else code))
    return web.Response(status=status, body=_json.encode(body), content_type="application/json")


def _model_not_found(name: str) -> web.Response:
    """OpenAI's (and vLLM's) answer for a model this server does not serve."""
    return _error(404, f"The model `{name}` does not exist.", "invalid_request_error", "model",
                  code="model_not_found")


def _chat_prompt(tokenizer: ChatTokenizer | None, messages: list[T.ChatMessage]) -> str | list[int]:
    """The model's chat template (token ids), or the plain format, rendered
    on the caller's thread (for tools; requests go through the engine
    client's text path); bad messages are a 400 naming the field."""
    try:
        return chat_prompt(tokenizer, messages)
    except ValueError as e:
        msg = str(e)
        param = msg.split(":", 1)[0] if msg.startswith("messages") else "messages"
        raise T.RequestValidationError(msg, param) from None


class _UnsupportedMediaType(Exception):
    pass


async def _read_body(request: web.Request) -> bytearray:
    """The body, read into one buffer that the JSON decoder reads as it is
    (``request.read()`` copies it once more: 10-20 ms of the loop for 16 MiB)."""
    declared = request.content_length
    if declared is not None and declared > MAX_BODY_BYTES:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=declared)
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=len(body))
    return body


def _client_left(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
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
    except ConnectionError:  # the client left while we wrote: nobody to answer
        log.debug(DISCONNECTED, path=request.path)
        return _error(499, "client disconnected", "invalid_request_error")
    except Exception as e:  # noqa: BLE001 - the last line of defence: never text/plain
        log.exception("request_handler_failed", path=request.path)
        return _error(500, f"internal error: {type(e).__name__}", "server_error")


class OpenAIServer:
    """Owns: the HTTP routes, the server-side metrics, and a text path over
    the engine's tokenizer for /tokenize and /detokenize. The engine is owned
    by whoever built this server (it closes it). ``model_name`` and
    ``max_model_len`` default to the engine's. A request leaving ``max_tokens``
    unset gets ``default_max_tokens`` on /v1/completions and, on
    /v1/chat/completions, the rest of the context (until EOS or the context
    ends, as vLLM does); unset sampling fields take the checkpoint's
    generation config (``Tokenizer.generation_defaults``)."""

    def __init__(self, engine: EngineClient, *, model_name: str | None = None, max_model_len: int | None = None,
                 default_max_tokens: int = 16) -> None:
        self.engine = engine
        self.model_name = model_name or engine.model_name
        self.max_model_len = engine.max_model_len if max_model_len is None else max_model_len
        self.default_max_tokens = default_max_tokens
        tokenizer = engine.tokenizer
        self.sampling_defaults = {} if tokenizer is None else dict(tokenizer.generation_defaults)
        self.text = PromptTokenizer(tokenizer, self.max_model_len)
        self.root = engine.config.model.model or self.model_name  # the checkpoint, as vLLM's card's ``root``
        self.metrics = ServerMetrics()
        self._created = int(time.time())

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_errors])
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model_id}", self.model),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/health", self.health),
            web.get("/metrics", self.prometheus),
            web.get("/fleet", self.fleet),
        ])
        return app

    async def _decode(self, request: web.Request, typ: type[R]) -> R:
        """The JSON body as ``typ``: _UnsupportedMediaType for a body that says
        it is not JSON (none said is taken as JSON), RequestValidationError
        for a malformed one, 413 past ``MAX_BODY_BYTES``."""
        ctype = request.headers.get(hdrs.CONTENT_TYPE)
        if ctype is not None and not _is_json(request.content_type):
            raise _UnsupportedMediaType(f"Content-Type must be application/json, got {request.content_type}")
        return T.decode_request(await _read_body(request), typ)

    async def _request(self, request: web.Request, typ: type[R]) -> R | web.Response:
        """Decode and check ``model``; a ``web.Response`` (415, 400, 404) when the request stops here."""
        try:
            req = await self._decode(request, typ)
        except _UnsupportedMediaType as e:
            self.metrics.count_request("invalid")
            return _error(415, str(e), "invalid_request_error", "Content-Type")
        except T.RequestValidationError as e:
            self.metrics.count_request("invalid")
            return _error(400, str(e), "invalid_request_error", e.param)
        if not self._serves(req.model):
            self.metrics.count_request("invalid")
            return _model_not_found(req.model)
        return req

    # --- endpoints ------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._request(request, T.CompletionRequest)
        if isinstance(req, web.Response):
            return req
        try:
            params = T.sampling_params(req, default_max_tokens=self.default_max_tokens,
                                       defaults=self.sampling_defaults)
            prompt, params = T.blend_prompt(req, T.completion_prompt(req), params)
        except T.RequestValidationError as e:
            self.metrics.count_request("invalid")
            return _error(400, str(e), "invalid_request_error", e.param)
        rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        return await self._serve(request, req, prompt, params, rid, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._request(request, T.ChatCompletionRequest)
        if isinstance(req, web.Response):
            return req
        try:
            mt = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            params = T.sampling_params(req, default_max_tokens=self.max_model_len, max_tokens=mt,
                                       defaults=self.sampling_defaults)
            prompt, params = T.blend_prompt(req, ChatPrompt(messages=req.messages), params)
        except T.RequestValidationError as e:
            self.metrics.count_request("invalid")
            return _error(400, str(e), "invalid_request_error", e.param)
        rid = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        return await self._serve(request, req, prompt, params, rid, chat=True)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a prompt or messages -> ``{count, max_model_len,
        tokens, token_strs}``; 400 when it cannot fit ``max_model_len``."""
        req = await self._request(request, T.TokenizeRequest)
        if isinstance(req, web.Response):
            return req
        try:
            ids = (await self.text.ids(T.tokenize_prompt(req))).ids  # the text path refuses what cannot fit
        except T.RequestValidationError as e:
            return _error(400, str(e), "invalid_request_error", e.param)
        except RequestError as e:
            return _error(400, str(e), "invalid_request_error", e.field)
        tok = self.text.tokenizer
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs and tok is not None else None
        body = T.TokenizeResponse(len(ids), self.max_model_len, ids, strs)
        return web.Response(body=_json.encode(body), content_type="application/json")

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: ``{tokens}`` -> ``{prompt}`` (special tokens kept)."""
        req = await self._request(request, T.DetokenizeRequest)
        if isinstance(req, web.Response):
            return req
        try:
            text = await self.text.decode(req.tokens)
        except RequestError as e:
            return _error(400, str(e), "invalid_request_error", e.field)
        return web.Response(body=_json.encode(T.DetokenizeResponse(text)), content_type="application/json")

    def _serves(self, name: str | None) -> bool:
        """A request may leave ``model`` out; if it names one, it must be ours."""
        return name is None or name == self.model_name

    def _card(self) -> T.ModelCard:
        return T.ModelCard(id=self.model_name, created=self._created, root=self.root,
                           max_model_len=self.max_model_len)

    async def models(self, request: web.Request) -> web.Response:
        return web.Response(body=_json.encode(T.ModelList([self._card()])), content_type="application/json")

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model_id"]
        if name != self.model_name:
            return _model_not_found(name)
        return web.Response(body=_json.encode(self._card()), content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        """200 {"status": "ok"}, or for a fleet with some replicas down
        200 {"status": "degraded", "replicas_down": [...]}; 503 while
        starting, when stalled (work queued, no progress for
        scheduler.stall_timeout_s) or dead (a fleet: no replica serving and
        none being started)."""
        try:
            h = await self.engine.check_health()
        except EngineDeadError as e:
            return _error(503, str(e), "engine_dead")
        if h.healthy and not h.replicas_down:
            return web.json_response({"status": h.status})
        body: dict[str, object] = {"status": h.status, "reason": h.reason}
        if h.replicas_down:
            body["replicas_down"] = list(h.replicas_down)
        if h.healthy:
            return web.json_response(body)
        body.update(seconds_since_progress=round(h.seconds_since_progress, 3), num_unfinished=h.num_unfinished)
        return web.json_response(body, status=503)

    async def fleet(self, request: web.Request) -> web.Response:
        """The replicas behind this server and the router's view (a fleet
        engine only: ``kvstrata serve --engines N`` or ``--engine ADDR``)."""
        if not isinstance(self.engine, FleetClient):
            return _error(404, "this server runs one engine, not a fleet", "invalid_request_error")
        return web.json_response(self.engine.fleet_status())

    async def prometheus(self, request: web.Request) -> web.Response:
        """The engine's stats; a fleet's totals and per-replica series (also
        while no replica serves: then its ``kvstrata_replica_up`` alone)."""
        try:
            if isinstance(self.engine, FleetClient):
                fleet = await self.engine.fleet_stats()
                text = render_metrics(fleet.totals, self.metrics, self.model_name, fleet=fleet)
            else:
                text = render_metrics(await self.engine.stats(), self.metrics, self.model_name)
        except EngineDeadError as e:
            return _error(503, str(e), "engine_dead")
        return web.Response(text=text, content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})

    # --- generation ------------------------------------------------------------------

    async def _serve(self, request: web.Request, req: T.CompletionRequest | T.ChatCompletionRequest,
                     prompt: Prompt, params: SamplingParams, rid: str, *, chat: bool) -> web.StreamResponse:
        timer = _Timer(self.metrics, time.perf_counter())
        with structlog.contextvars.bound_contextvars(request_id=rid):
            agen = self.engine.generate(prompt, params, request_id=rid, priority=req.priority,
                                        cache_salt=req.cache_salt, session_key=req.user or None)
            try:
                try:
                    first = await anext(agen)  # errors before any byte is sent become 4xx/5xx
                except RequestError as e:
                    timer.count("invalid")
                    return _error(400, str(e), "invalid_request_error", e.field)
                except EngineOverloadedError as e:
                    timer.count("overloaded")
                    return _error(503, str(e), "overloaded")
                except EngineDeadError as e:
                    timer.count("engine_dead")
                    return _error(503, str(e), "engine_dead")
                want_lp = params.logprobs is not None
                if req.stream:
                    return await self._stream(request, req, _chain(first, agen), rid, timer, chat=chat,
                                              logprobs=want_lp)
                try:
                    return await self._complete(_chain(first, agen), rid, timer, chat=chat, logprobs=want_lp)
                except EngineDeadError as e:
                    timer.count("engine_dead")
                    return _error(503, str(e), "engine_dead")
            except asyncio.CancelledError:  # aiohttp cancels the handler of a closed connection
                if _client_left(request):
                    self._disconnected(timer)
                raise
            finally:
                await agen.aclose()

    async def _complete(self, outs: AsyncIterator[RequestOutput], rid: str, timer: "_Timer",
                        *, chat: bool, logprobs: bool = False) -> web.Response:
        text: list[str] = []
        lps: list = []
        last: RequestOutput | None = None
        async for out in outs:
            timer.output(out)
            text.append(out.text_delta)
            if out.logprobs:
                lps.extend(out.logprobs)
            last = out
        assert last is not None and last.finished  # the generator ends with the finished output
        if last.finish_reason == "error":
            timer.count("error")
            return _error(500, last.error or "request failed", "engine_error")
        usage = self._usage(last, timer.n_out)
        timer.finish(last)
        now = int(time.time())
        tok = self.engine.tokenizer
        if chat:
            lp = T.chat_logprobs(lps, tok) if logprobs else None
            choice = T.ChatChoice(0, T.ChatResponseMessage("assistant", "".join(text)), last.finish_reason, lp)
            body: T.ChatResponse | T.CompletionResponse = T.ChatResponse(rid, now, self.model_name, [choice], usage)
        else:
            lp = T.completion_logprobs(lps, tok) if logprobs else None
            body = T.CompletionResponse(rid, now, self.model_name,
                                        [T.CompletionChoice(0, "".join(text), last.finish_reason, lp)], usage)
        return web.Response(body=_json.encode(body), content_type="application/json")

    async def _stream(self, request: web.Request, req: T.CompletionRequest | T.ChatCompletionRequest,
                      outs: AsyncIterator[RequestOutput], rid: str,
                      timer: "_Timer", *, chat: bool, logprobs: bool = False) -> web.StreamResponse:
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        now = int(time.time())
        model = self.model_name
        tok = self.engine.tokenizer
        text_offset = 0
        last: RequestOutput | None = None
        try:
            await resp.prepare(request)  # a client gone before the headers fails here
            if chat:
                await resp.write(_sse(T.ChatChunk(rid, now, model, [T.ChatStreamChoice(
                    0, T.ChatResponseMessage("assistant", ""))])))
            async for out in outs:
                timer.output(out)
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
                    chunk: T.ChatChunk | T.CompletionResponse = T.ChatChunk(rid, now, model, [T.ChatStreamChoice(
                        0, T.ChatResponseMessage(content=out.text_delta), fr, lp)])
                else:
                    lp = None if lps is None else T.completion_logprobs(lps, tok, text_offset)
                    text_offset += len(out.text_delta)
                    chunk = T.CompletionResponse(rid, now, model, [T.CompletionChoice(0, out.text_delta, fr, lp)])
                await resp.write(_sse(chunk))
            assert last is not None and last.finished
            timer.finish(last)
            if req.stream_options is not None and req.stream_options.include_usage:
                usage = self._usage(last, timer.n_out)
                tail: T.ChatChunk | T.CompletionResponse = (T.ChatChunk(rid, now, model, [], usage) if chat
                             else T.CompletionResponse(rid, now, model, [], usage))
                await resp.write(_sse(tail))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:  # the client went away (before the headers or mid-write): one quiet line
            self._disconnected(timer)  # _serve closes the generator: that aborts the request
        except EngineDeadError as e:  # headers are sent: report in-band, then end the stream
            timer.count("engine_dead")
            await resp.write(_sse(T.ErrorResponse(T.ErrorBody(message=str(e), type="engine_dead", code=503))))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        return resp

    def _disconnected(self, timer: "_Timer") -> None:
        timer.count(DISCONNECTED)
        log.debug(DISCONNECTED, tokens_sent=timer.n_out)

    def _usage(self, last: RequestOutput, n_out: int) -> T.Usage:
        p = last.num_prompt_tokens
        return T.Usage(p, n_out, p + n_out, T.PromptTokensDetails(last.num_cached_tokens))


class _Timer:
    """One request's latency bookkeeping for the server histograms, its
    output token count, and its outcome (counted once)."""

    __slots__ = ("m", "start", "last", "n_out", "counted")

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self.m = metrics
        self.start = start
        self.last: float | None = None
        self.n_out = 0
        self.counted = False

    def output(self, out: RequestOutput) -> None:
        if not out.new_token_ids:
            return
        self.n_out += len(out.new_token_ids)
        now = time.perf_counter()
        if self.last is None:
            self.m.ttft.observe(now - self.start)
        else:
            self.m.itl.observe(now - self.last)
        self.last = now

    def count(self, outcome: str) -> None:
        """The request's outcome in ``kvstrata_http_requests_total`` (the first one given)."""
        if not self.counted:
            self.counted = True
            self.m.count_request(outcome)

    def finish(self, last: RequestOutput) -> None:
        self.m.e2e.observe(time.perf_counter() - self.start)
        self.count(last.finish_reason or "unknown")
        self.m.prompt_tokens += last.num_prompt_tokens
        self.m.generation_tokens += self.n_out


async def _chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    if first.finished:
        return
    async for out in rest:
        yield out


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or (content_type.startswith("application/")
                                                    and content_type.endswith("+json"))


def _sse(obj: msgspec.Struct) -> bytes:
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
