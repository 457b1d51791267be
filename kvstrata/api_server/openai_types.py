"""OpenAI-compatible request and response bodies, as msgspec Structs.

Requests are decoded with one typed decoder each; a wrong type or a missing
field is a ``RequestValidationError`` naming the field (the server answers 400
with ``error.param`` set). Unknown fields are ignored, as OpenAI clients send
many (but the whole body must be UTF-8). Only n=1 and unbatched prompts are
supported; asking for more is a 400. ``blend`` (a kvstrata extension,
``BlendRequest``) asks for CacheBlend: ``blend_prompt`` turns it into a
``SegmentedPrompt`` (tokenized piece by piece by the engine client's text
path) or, for token spans, the request's ``BlendSpec``. Sampling fields a
request leaves unset take the checkpoint's defaults (its
generation_config.json), then OpenAI's. ``/tokenize`` and ``/detokenize``
have vLLM's shapes.

Only the shape of the JSON is checked here. Values (ranges, token ids,
lengths) are checked once, by the engine client's input processor
(``kvstrata.enginecore.processing``), whose ``RequestError`` the server maps
to the same 400 naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from kvstrata.text.prompts import ChatPrompt, Prompt, SegmentedPrompt, TextPrompt
from kvstrata.types import DEFAULT_BLEND_RATIO, BlendSpec, Logprobs, SamplingParams

if TYPE_CHECKING:
    from kvstrata.text.tokenizer import Tokenizer

R = TypeVar("R", bound=msgspec.Struct)  # a request body's type

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
    temperature: float | None = None  # None: the checkpoint's default, else OpenAI's (_UNSET_SAMPLING)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
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
    prompt: str | list[Any]  # Any: str, token ids, or a one-element batch of either (checked on use)
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


def decode_request(body: bytes | bytearray, typ: type[R]) -> R:
    try:
        if not body.isascii():  # msgspec checks the strings it keeps, not the keys and values it skips
            body.decode("utf-8")
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


# What a sampling field is when neither the request nor the checkpoint sets it.
_UNSET_SAMPLING: Mapping[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}


def sampling_params(req: _SamplingFields, *, default_max_tokens: int = 16, max_tokens: int | None = None,
                    defaults: Mapping[str, float | int] | None = None) -> SamplingParams:
    """Map OpenAI fields to SamplingParams (their values are the engine client's
    to check). A field left unset takes ``defaults`` (the checkpoint's
    generation config: ``Tokenizer.generation_defaults``), then OpenAI's;
    ``max_tokens`` then ``default_max_tokens``."""
    if req.n != 1:
        raise RequestValidationError(f"n: only n=1 is supported, got {req.n}", "n")
    defaults = defaults or {}
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    logprobs = req.top_logprobs if isinstance(req.logprobs, bool) else req.logprobs
    if req.logprobs is True and logprobs is None:
        logprobs = 0
    if req.logprobs is False:
        logprobs = None
    picked = {name: value if (value := getattr(req, name)) is not None else defaults.get(name, unset)
              for name, unset in _UNSET_SAMPLING.items()}
    mt = max_tokens if max_tokens is not None else req.max_tokens
    if mt is None:
        mt = defaults.get("max_tokens", default_max_tokens)
    return SamplingParams(
        **picked, seed=req.seed, max_tokens=mt, min_tokens=req.min_tokens,
        stop_token_ids=list(req.stop_token_ids), stop=stop, ignore_eos=req.ignore_eos, logprobs=logprobs)


def blend_prompt(req: _SamplingFields, prompt: str | list[int] | ChatPrompt,
                 params: SamplingParams) -> tuple[Prompt, SamplingParams]:
    """With ``req.blend``: the prompt with its segments (``SegmentedPrompt``,
    for ``segments`` or ``separator``), or the params carrying token
    ``spans`` (``BlendSpec``); nothing is tokenized here. Which of the three
    is given is checked here; the segments themselves and every value, once,
    by the engine client (a 400 naming the field)."""
    b = req.blend
    if b is None:
        return prompt, params
    given = [name for name in ("segments", "separator", "spans") if getattr(b, name) is not None]
    if len(given) != 1:
        raise RequestValidationError("blend: give exactly one of segments, separator or spans, got "
                                     f"{given or 'none'}", "blend")
    ratio = DEFAULT_BLEND_RATIO if b.recompute_ratio is None else b.recompute_ratio
    if b.spans is not None:
        if isinstance(prompt, str):
            raise RequestValidationError("blend.spans: needs a prompt of token ids (for text, give "
                                         "blend.segments or blend.separator)", "blend.spans")
        spec = BlendSpec(segments=[(int(s), int(e)) for s, e in b.spans], recompute_ratio=float(ratio))
        return prompt, msgspec.structs.replace(params, blend=spec)
    if not isinstance(prompt, (str, ChatPrompt)):
        raise RequestValidationError(f"blend.{given[0]}: needs a text prompt (for token ids, give blend.spans)",
                                     f"blend.{given[0]}")
    return SegmentedPrompt(prompt=prompt, segments=b.segments, separator=b.separator,
                           recompute_ratio=float(ratio)), params


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
    logprobs: dict[str, object] | None = None  # completion_logprobs' JSON


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
    logprobs: dict[str, object] | None = None  # chat_logprobs' JSON


class ChatStreamChoice(msgspec.Struct, frozen=True):
    index: int
    delta: ChatResponseMessage
    finish_reason: str | None = None
    logprobs: dict[str, object] | None = None  # chat_logprobs' JSON


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
    """vLLM's model card: ``root`` the checkpoint the model was loaded from
    (``vllm bench serve`` loads its tokenizer from it), ``parent`` the base
    model of an adapter (None: a base model)."""

    id: str
    created: int
    owned_by: str = "kvstrata"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    object: str = "model"


class ModelList(msgspec.Struct, frozen=True):
    data: list[ModelCard]
    object: str = "list"


# --- /tokenize and /detokenize, vLLM's shapes ------------------------------------


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's TokenizeCompletionRequest (``prompt``) or TokenizeChatRequest
    (``messages``): exactly one of the two. ``add_special_tokens`` defaults
    as there: True for a prompt, False for messages (their template writes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False


def tokenize_prompt(req: TokenizeRequest) -> Prompt:
    """The prompt a /tokenize request names, for the engine client's text path."""
    if (req.prompt is None) == (req.messages is None):
        raise RequestValidationError("give exactly one of prompt or messages", "prompt")
    if req.continue_final_message:
        raise RequestValidationError("continue_final_message: not supported", "continue_final_message")
    if req.prompt is not None:
        return TextPrompt(req.prompt, True if req.add_special_tokens is None else req.add_special_tokens)
    assert req.messages is not None
    return ChatPrompt(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                      add_special_tokens=bool(req.add_special_tokens))


class TokenizeResponse(msgspec.Struct, frozen=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, frozen=True):
    prompt: str


# --- log-probabilities in OpenAI's shapes ----------------------------------------

_MIN_LOGPROB = -9999.0  # OpenAI's stand-in for -inf (JSON has no infinity)


def token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    """One token as text (special tokens included); ``token_id:N`` without a tokenizer."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _lp(value: float) -> float:
    return value if value > _MIN_LOGPROB else _MIN_LOGPROB


def completion_logprobs(lps: list[Logprobs], tokenizer: Tokenizer | None, text_offset: int = 0) -> dict[str, object]:
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


def chat_logprobs(lps: list[Logprobs], tokenizer: Tokenizer | None) -> dict[str, object]:
    """``/v1/chat/completions`` ``logprobs``: ``{"content": [{token, logprob,
    bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""
    content = []
    for lp in lps:
        s = token_text(tokenizer, lp.token_ids[0])
        top = [{"token": (t := token_text(tokenizer, i)), "logprob": _lp(v), "bytes": list(t.encode())}
               for i, v in zip(lp.token_ids[1:], lp.logprobs[1:])]
        content.append({"token": s, "logprob": _lp(lp.logprobs[0]), "bytes": list(s.encode()), "top_logprobs": top})
    return {"content": content}
