"""OpenAI-compatible request and response bodies, as msgspec Structs.

Requests are decoded with one typed decoder each; a wrong type or a missing
field is a ``RequestValidationError`` naming the field (the server answers 400
with ``error.param`` set). Unknown fields are ignored, as OpenAI clients send
many. Only n=1 and unbatched prompts are supported; asking for more is a 400.
``blend`` (a kvstrata extension, ``BlendRequest``) asks for CacheBlend: the
prompt is then tokenized here, segment by segment (``apply_blend``).

Only the shape of the JSON is checked here. Values (ranges, token ids,
lengths) are checked once, by the engine client's input processor
(``kvstrata.enginecore.processing``), whose ``RequestError`` the server maps
to the same 400 naming the field.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from kvstrata.text.segments import SegmentError, segments_in, split_on
from kvstrata.types import DEFAULT_BLEND_RATIO, BlendSpec, Logprobs, SamplingParams

_AT_PATH = re.compile(r" - at `\$\.?([^`]*)`")


class RequestValidationError(ValueError):
    """A request body that cannot be served; ``param`` names the field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class BlendRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """CacheBlend for one request (kvstrata extension): the passages whose KV
    is reused wherever they sit, as ``segments`` (texts found in the prompt,
    in order), a ``separator`` splitting the prompt (the pieces between its
    first and last occurrence), or ``spans`` (``[start, end)`` token spans of
    a token-id prompt); ``recompute_ratio`` in [0, 1] (default: the
    engine's, ``kvstrata.types.DEFAULT_BLEND_RATIO``)."""

    segments: list[str] | None = None
    separator: str | None = None
    spans: list[tuple[int, int]] | None = None
    recompute_ratio: float | None = None


class _SamplingFields(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | bool | None = None
    top_logprobs: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    user: str | None = None
    blend: BlendRequest | None = None


class CompletionRequest(_SamplingFields, frozen=True, kw_only=True):
    prompt: str | list[Any]  # str, token ids, or a one-element batch of either
    echo: bool = False


class ContentPart(msgspec.Struct, frozen=True):
    type: str
    text: str = ""


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_SamplingFields, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def decode_request(body: bytes, typ: type) -> Any:
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _AT_PATH.search(msg)
        param = m.group(1) if m else _missing_field(msg)
        raise RequestValidationError(msg, param) from None
    except msgspec.DecodeError as e:
        raise RequestValidationError(f"request body is not valid JSON: {e}", None) from None
    except UnicodeDecodeError as e:
        raise RequestValidationError(f"request body is not valid UTF-8 (byte {e.start}): {e.reason}", None) from None


def _missing_field(msg: str) -> str | None:
    m = re.search(r"missing required field `([^`]+)`", msg)
    return m.group(1) if m else None


def sampling_params(req: _SamplingFields, *, default_max_tokens: int = 16,
                    max_tokens: int | None = None) -> SamplingParams:
    """Map OpenAI fields to SamplingParams (their values are the engine client's to check)."""
    if req.n != 1:
        raise RequestValidationError(f"n: only n=1 is supported, got {req.n}", "n")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    logprobs = req.top_logprobs if isinstance(req.logprobs, bool) else req.logprobs
    if req.logprobs is True and logprobs is None:
        logprobs = 0
    if req.logprobs is False:
        logprobs = None
    mt = max_tokens if max_tokens is not None else req.max_tokens
    return SamplingParams(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        seed=req.seed, max_tokens=default_max_tokens if mt is None else mt,
        min_tokens=req.min_tokens, stop_token_ids=list(req.stop_token_ids), stop=stop,
        ignore_eos=req.ignore_eos, logprobs=logprobs)


def apply_blend(req: _SamplingFields, prompt: str | list[int], params: SamplingParams,
                tokenizer: Any, *, add_special: bool = True) -> tuple[str | list[int], SamplingParams]:
    """With ``req.blend``: the prompt as token ids tokenized piece by piece
    (``kvstrata.text.segments``; ``add_special``: with the tokenizer's
    special tokens, as a text prompt is) and the params carrying the BlendSpec."""
    b = req.blend
    if b is None:
        return prompt, params
    given = [name for name in ("segments", "separator", "spans") if getattr(b, name) is not None]
    if len(given) != 1:
        raise RequestValidationError("blend: give exactly one of segments, separator or spans, got "
                                     f"{given or 'none'}", "blend")
    ratio = DEFAULT_BLEND_RATIO if b.recompute_ratio is None else b.recompute_ratio
    if b.spans is not None:
        if not isinstance(prompt, list):
            raise RequestValidationError("blend.spans: needs a prompt of token ids (for text, give "
                                         "blend.segments or blend.separator)", "blend.spans")
        ids, spans = prompt, [(int(s), int(e)) for s, e in b.spans]
    else:
        if not isinstance(prompt, str):
            raise RequestValidationError(f"blend.{given[0]}: needs a text prompt (for token ids, give blend.spans)",
                                         f"blend.{given[0]}")
        if tokenizer is None:
            raise RequestValidationError("blend: this engine has no tokenizer; give token ids and blend.spans",
                                         "blend")
        try:
            ids, spans = (segments_in(tokenizer, prompt, b.segments, add_special=add_special)
                          if b.segments is not None
                          else split_on(tokenizer, prompt, b.separator or "", add_special=add_special))
        except SegmentError as e:
            raise RequestValidationError(str(e), e.field) from None
    # The spec's values (ratio, spans) are checked once, by the engine client (a 400 naming the field).
    return ids, msgspec.structs.replace(params, blend=BlendSpec(segments=spans, recompute_ratio=float(ratio)))


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The prompt: text or token ids, unwrapped from a one-element batch."""
    p = req.prompt
    if isinstance(p, list) and p and not isinstance(p[0], int):
        if len(p) != 1:
            raise RequestValidationError("prompt: batched prompts are not supported (send one per request)", "prompt")
        p = p[0]
    if req.echo:
        raise RequestValidationError("echo: not supported", "echo")
    return p


# --- responses ---------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int = 0


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(msgspec.Struct, frozen=True):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: Any = None


class CompletionResponse(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ChatResponseMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChoice(msgspec.Struct, frozen=True):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None = None
    logprobs: Any = None


class ChatStreamChoice(msgspec.Struct, frozen=True):
    index: int
    delta: ChatResponseMessage
    finish_reason: str | None = None
    logprobs: Any = None


class ChatResponse(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    object: str = "chat.completion"


class ChatChunk(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class ErrorBody(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None  # the HTTP status, or OpenAI's error code ("model_not_found")


class ErrorResponse(msgspec.Struct, frozen=True):
    error: ErrorBody


class ModelCard(msgspec.Struct, frozen=True):
    id: str
    created: int
    owned_by: str = "kvstrata"
    max_model_len: int | None = None
    object: str = "model"


class ModelList(msgspec.Struct, frozen=True):
    data: list[ModelCard]
    object: str = "list"


# --- log-probabilities in OpenAI's shapes ----------------------------------------

_MIN_LOGPROB = -9999.0  # OpenAI's stand-in for -inf (JSON has no infinity)


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token as text (special tokens included); ``token_id:N`` without a tokenizer."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _lp(value: float) -> float:
    return value if value > _MIN_LOGPROB else _MIN_LOGPROB


def completion_logprobs(lps: list[Logprobs], tokenizer: Any, text_offset: int = 0) -> dict[str, Any]:
    """``/v1/completions`` ``logprobs``: parallel lists of the sampled tokens,
    their log-probabilities, the top-n alternatives (token -> logprob) and
    each token's character offset in the text (from ``text_offset``)."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top: list[dict[str, float]] = []
    offsets: list[int] = []
    for lp in lps:
        s = token_text(tokenizer, lp.token_ids[0])
        tokens.append(s)
        token_logprobs.append(_lp(lp.logprobs[0]))
        top.append({token_text(tokenizer, t): _lp(v) for t, v in zip(lp.token_ids[1:], lp.logprobs[1:])})
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(lps: list[Logprobs], tokenizer: Any) -> dict[str, Any]:
    """``/v1/chat/completions`` ``logprobs``: ``{"content": [{token, logprob,
    bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""
    content = []
    for lp in lps:
        s = token_text(tokenizer, lp.token_ids[0])
        top = [{"token": (t := token_text(tokenizer, i)), "logprob": _lp(v), "bytes": list(t.encode())}
               for i, v in zip(lp.token_ids[1:], lp.logprobs[1:])]
        content.append({"token": s, "logprob": _lp(lp.logprobs[0]), "bytes": list(s.encode()), "top_logprobs": top})
    return {"content": content}
