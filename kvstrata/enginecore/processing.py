"""Client-side request processing, vLLM's split: the engine core deals in
token ids only; the client turns text into ids on the way in and ids into
text on the way out.

    prompt (str | ids) ──► InputProcessor.process ──► EngineRequest (checked ids) ──► engine
    engine ──► RequestOutput (ids) ──► OutputProcessor.process ──► RequestOutput (+ text)

Both run in the client's own coroutine (``AsyncEngine.generate`` in
process, ``MPEngineClient.generate`` in the client process, ``FleetClient``
once for all its replicas), never in the engine step. Text of every kind
(a text, a conversation, blend segments) becomes ids through the one text
path, ``kvstrata.text.prompts.PromptTokenizer``: bounds first, long texts
tokenized in a worker thread without the GIL. Every check of a request's
fields lives here (``validate_request``), once per request; the HTTP layer
checks only the shape of its JSON, the engine core trusts what it is given
(the ZMQ engine server checks again: any local process may connect to it).

Stop strings are text, so they are the client's: when one matches, the
output processor ends the stream (finish_reason "stop", stop_reason the
string) and the client aborts the request in the engine. Stop token ids
(EOS, ``stop_token_ids``) and lengths stay in the engine.
"""

from __future__ import annotations

import uuid

import msgspec

from kvstrata.enginecore.request import EngineRequest
from kvstrata.errors import RequestError
from kvstrata.text.detokenizer import IncrementalDetokenizer
from kvstrata.text.prompts import Prompt, PromptTokenizer, SegmentedPrompt
from kvstrata.text.tokenizer import Tokenizer
from kvstrata.types import BlendSpec, RequestOutput, SamplingParams


class ModelFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What request checks need to know of the engine: its context limit
    (already capped by the KV pool) and its vocabulary (None: unknown)."""

    max_model_len: int
    vocab_size: int | None = None


MAX_ID_CHARS = 1024  # request_id, cache_salt, lora_name


def validate_request(req: EngineRequest, facts: ModelFacts) -> None:
    """Raise RequestError naming the first bad field of ``req``."""
    if not isinstance(req.request_id, str) or not req.request_id:
        raise RequestError("request_id", f"must be a non-empty str, got {req.request_id!r}")
    if len(req.request_id) > MAX_ID_CHARS:
        raise RequestError("request_id", f"must be at most {MAX_ID_CHARS} characters, got {len(req.request_id)}")
    ids = req.prompt_token_ids
    if not ids:
        raise RequestError("prompt", "must not be empty")
    if len(ids) > facts.max_model_len:
        raise RequestError(
            "prompt", f"has {len(ids)} tokens, longer than max_model_len={facts.max_model_len}"
        )
    if set(map(type, ids)) != {int}:  # bool is not an int here; all in C
        raise RequestError("prompt", "token ids must be integers")
    lo, hi = min(ids), max(ids)
    vocab_size = facts.vocab_size
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        raise RequestError(
            "prompt", f"token ids must be in [0, {vocab_size}), got min {lo} and max {hi}"
        )
    params = req.sampling_params
    if not isinstance(params, SamplingParams):
        raise RequestError("sampling_params", f"must be a SamplingParams, got {type(params).__name__}")
    try:
        params.validate()
    except (ValueError, TypeError) as exc:
        message = str(exc)
        raise RequestError(message.split(" ", 1)[0], message) from None
    if params.blend is not None:
        try:
            params.blend.check_prompt(len(ids))
        except ValueError as exc:
            raise RequestError("blend.segments", str(exc)) from None
    if type(req.priority) is not int or not -(2**63) <= req.priority < 2**63:
        raise RequestError("priority", f"must be an integer that fits in 64 bits, got {req.priority!r}")
    for name in ("cache_salt", "lora_name"):
        value = getattr(req, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise RequestError(name, f"must be a non-empty str or None, got {value!r}")
        if value is not None and len(value) > MAX_ID_CHARS:
            raise RequestError(name, f"must be at most {MAX_ID_CHARS} characters, got {len(value)}")


class InputProcessor:
    """Turns what a caller gives (a ``kvstrata.text.prompts.Prompt``:
    text, a conversation, blend segments or ids; parameters) into a checked
    ``EngineRequest``. Owns nothing mutable: the engine's facts and the text
    path over the tokenizer (None: prompts must be token ids)."""

    __slots__ = ("facts", "text")

    def __init__(self, facts: ModelFacts, tokenizer: Tokenizer | None) -> None:
        self.facts = facts
        self.text = PromptTokenizer(tokenizer, facts.max_model_len)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.text.tokenizer

    async def process(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> EngineRequest:
        """Tokenize (bounded first; off the loop when long) and check; raises RequestError."""
        ids, spans = await self.text.ids(prompt)
        params = SamplingParams() if params is None else params
        if spans is not None:
            assert isinstance(prompt, SegmentedPrompt)
            params = _replace(params, blend=BlendSpec(segments=spans, recompute_ratio=prompt.recompute_ratio))
        req = EngineRequest(
            request_id=uuid.uuid4().hex if request_id is None else request_id,
            prompt_token_ids=ids, sampling_params=params,
            priority=priority, cache_salt=cache_salt, lora_name=lora_name,
        )
        validate_request(req, self.facts)
        return req


class OutputProcessor:
    """One request's outputs as its client sees them: incremental text, and
    the end of the stream at a stop string. Owns: the request's incremental
    detokenizer (None without a tokenizer: no text, no stop strings) and
    whether the stream has ended.

    ``process`` is called with the engine's outputs in order until it
    returns a finished one. ``engine_still_running`` is then True when a
    stop string ended the stream before the engine finished the request:
    the caller aborts it in the engine.
    """

    __slots__ = ("_detok", "finished", "engine_still_running")

    def __init__(self, tokenizer: Tokenizer | None, req: EngineRequest) -> None:
        params = req.sampling_params
        self._detok = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, req.prompt_token_ids, params.stop, params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )
        self.finished = False
        self.engine_still_running = False

    def process(self, out: RequestOutput) -> RequestOutput:
        """The text delta of ``out``; a matched stop string ends the stream
        there ("stop", stop_reason the string), even on a length stop."""
        detok = self._detok
        ids = out.new_token_ids
        finished = out.finished
        if detok is None or not ids:  # no text to make (abort, error, no tokenizer)
            if finished:
                self.finished = True
            return out
        # An engine stop with tokens is EOS or a stop token id: its text is left out.
        text, matched = detok.update(ids, finished=finished, stop_terminated=out.finish_reason == "stop")
        if matched is None:
            if finished:
                self.finished = True
            return _replace(out, text_delta=text)
        self.finished = True
        self.engine_still_running = not finished
        return _replace(out, text_delta=text, finished=True, finish_reason="stop", stop_reason=matched)


_replace = msgspec.structs.replace
