"""Prompts before they are token ids, and the one path that makes them ids.

Whatever the door (``/v1/completions``, ``/v1/chat/completions``, their
``blend`` extension, ``/tokenize``, ``EngineClient.chat``, a fleet), a prompt
given as text becomes token ids in ``PromptTokenizer.ids``, which the engine
client's input processor (``kvstrata.enginecore.processing``) calls once per
request:

    str | TextPrompt | ChatPrompt | SegmentedPrompt | token ids
      1. bounds, nothing tokenized yet: messages and content parts
         <= max_model_len, blend segments <= 64, characters <= max_prompt_chars
         (max_model_len x the characters one token can stand for: a longer
         text cannot fit the context)
      2. render the chat template; cut the text into blend pieces (str.find)
      3. tokenize: up to ``inline_chars`` characters on the caller's thread
         (about a millisecond); longer texts in this PromptTokenizer's worker
         threads (``max_workers``; the others queue without holding a thread)
         through the tokenizer's batch call, which releases the GIL
      -> PromptIds(ids, spans)

The workers run at the lowest CPU priority (Linux: nice 19, per thread) and
tokenize on their own thread (``TOKENIZERS_PARALLELISM`` defaults to false
once they start, so the ``tokenizers`` package does not hand the work to its
own thread pool, whose priority is not ours to set): on a host with fewer
idle cores than busy threads, the event loop and the model step get the CPU
first, and a long prompt's tokenization takes what is left. Measured with
tests/api_server/test_long_prompts.py on this 2-core host at load 10, three
runs each: /health's median 1.01-1.16x idle at normal priority, 0.91-1.02x
at nice 19 (the neighbour's inter-token latency 1.00-1.10x either way).

Why worker threads with the batch call and not a process pool with the
tokenizer loaded in each worker (measured on the same host while other test
suites ran, SmolLM2's byte-level BPE, the prompt ``"ab|" * n``, median of 3;
"stall" is the longest the event loop went without running):

    characters   on the loop        to_thread(encode)   to_thread(encode_batch_fast)   process pool (2)
    660 k        2.49 s, 2.49 s     2.99 s, 2.96 s      1.78 s, 0.022 s                4.52 s, 0.073 s
    3 M          7.95 s, 7.95 s     11.8 s, 11.5 s      4.11 s, 0.069 s                10.6 s, 0.156 s
                 (latency, stall; a second run, on a quieter moment, 660 k: 0.95 s on the loop,
                 encode_batch_fast 0.61 s with a 0.012 s stall, the pool 1.17 s with 0.020 s)

``encode`` holds the GIL for the whole call, so a plain thread does not help
the loop; ``encode_batch_fast`` releases it (what remains of the stall is
building the list of ids) and skips the character offsets, and it has no
pickling of the text and of the ids, which costs the pool its latency and
its own stalls. With the character bound, a prompt that cannot fit is
refused before any of this (a 3 MB prompt in microseconds).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

import msgspec

from kvstrata.errors import RequestError
from kvstrata.text.chat import message_dicts, plain_chat
from kvstrata.text.segments import SegmentError, encode_pieces, join_pieces, segment_pieces, separator_pieces
from kvstrata.text.tokenizer import Tokenizer
from kvstrata.types import DEFAULT_BLEND_RATIO, MAX_BLEND_SEGMENTS

INLINE_CHARS = 4096  # tokenized on the caller's thread up to this (a few ms at most)
INLINE_IDS = 4096  # decoded on the caller's thread up to this many ids
MAX_WORKERS = 2  # worker-thread tokenizations at once, per PromptTokenizer
WORKER_NICE = 19  # the workers' CPU priority (Linux), below the loop's and the model step's
_T = TypeVar("_T")


class TextPrompt(msgspec.Struct, frozen=True):
    """A text; ``add_special_tokens``: with the tokenizer's BOS (and the like)."""

    text: str
    add_special_tokens: bool = True


class ChatPrompt(msgspec.Struct, frozen=True, kw_only=True):
    """A conversation (``{"role", "content"}`` dicts or objects), rendered with
    the model's chat template, or the plain format for a checkpoint without
    one. ``add_special_tokens`` None: only the plain format's (a template
    writes its own)."""

    messages: list[Any]  # Any: free-form messages (dicts or Structs) on the wire; message_dicts checks them
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None


class SegmentedPrompt(msgspec.Struct, frozen=True, kw_only=True):
    """A prompt with CacheBlend segments given as text (``kvstrata.text.segments``):
    exactly one of ``segments`` (texts found in the prompt, in order) and
    ``separator``; the request's ``BlendSpec`` gets their token spans."""

    prompt: str | ChatPrompt
    segments: list[str] | None = None
    separator: str | None = None
    recompute_ratio: float = DEFAULT_BLEND_RATIO


Prompt = str | list[int] | TextPrompt | ChatPrompt | SegmentedPrompt


class PromptIds(NamedTuple):
    ids: list[int]
    spans: list[tuple[int, int]] | None = None  # the blend segments' token spans (a SegmentedPrompt's)


class PromptTokenizer:
    """Turns prompts into token ids without holding the event loop.

    Owns: the tokenizer (None: prompts must be token ids), the bounds derived
    from it and ``max_model_len`` (``max_prompt_chars``: None when the
    tokenizer gives no sound bound), and the worker threads (started with
    the first long text; idle ones end with this object).
    """

    __slots__ = ("tokenizer", "max_model_len", "max_prompt_chars", "inline_chars", "max_workers", "_workers")

    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int, *, inline_chars: int = INLINE_CHARS,
                 max_workers: int = MAX_WORKERS) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        per_token = None if tokenizer is None else tokenizer.max_token_chars
        self.max_prompt_chars = None if per_token is None else max_model_len * per_token
        self.inline_chars = inline_chars
        self.max_workers = max_workers
        self._workers: ThreadPoolExecutor | None = None

    async def ids(self, prompt: Prompt) -> PromptIds:
        """The prompt's token ids; RequestError naming the field when it is
        malformed or cannot fit (token ids are passed on unchecked:
        ``validate_request`` checks them)."""
        match prompt:
            case str():
                return PromptIds(await self._text(prompt, True, "prompt"))
            case TextPrompt(text=text, add_special_tokens=special):
                return PromptIds(await self._text(text, special, "prompt"))
            case ChatPrompt():
                text, special = self.render(prompt)
                return PromptIds(await self._text(text, special, "messages"))
            case SegmentedPrompt():
                return await self._segmented(prompt)
            case list() | tuple():
                return PromptIds(list(prompt))
        raise RequestError("prompt", f"must be a str or a list of token ids, got {type(prompt).__name__}")

    def render(self, chat: ChatPrompt) -> tuple[str, bool]:
        """The conversation as text, and whether to add the tokenizer's special
        tokens when tokenizing it. Bounded before rendering: more messages and
        content parts than ``max_model_len`` cannot fit (each is a token at least)."""
        tok = self._need_tokenizer("messages")
        msgs = chat.messages
        if not isinstance(msgs, (list, tuple)):
            raise RequestError("messages", f"must be a list of messages, got {type(msgs).__name__}")
        items = len(msgs) + sum(len(c) for m in msgs if isinstance(c := _content(m), (list, tuple)))
        if items > self.max_model_len:
            raise RequestError("messages", f"{items} messages and content parts cannot fit in "
                                           f"max_model_len={self.max_model_len}")
        try:
            dicts = message_dicts(msgs)
            template = tok.chat_template
            if template is None:
                text, special = plain_chat(dicts), True
            else:
                text, special = template.render(dicts, add_generation_prompt=chat.add_generation_prompt), False
        except ValueError as e:  # a bad message, or a template that refuses the conversation
            msg = str(e)
            raise RequestError(msg.split(":", 1)[0] if msg.startswith("messages") else "messages", msg) from None
        return text, special if chat.add_special_tokens is None else chat.add_special_tokens

    async def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (in a worker thread when long); RequestError
        ("tokens") for more ids than ``max_model_len`` or ids outside the vocabulary."""
        tok = self._need_tokenizer("tokens")
        if len(ids) > self.max_model_len:
            raise RequestError("tokens", f"has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        if ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= tok.vocab_size):
            raise RequestError("tokens", f"token ids must be integers in [0, {tok.vocab_size})")
        if len(ids) <= INLINE_IDS:
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return (await self._off_loop(tok.decode_batch, [ids], skip_special_tokens))[0]

    # --- internals ------------------------------------------------------------------

    def _need_tokenizer(self, field: str) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError(field, "this engine has no tokenizer; pass token ids")
        return self.tokenizer

    def _check_chars(self, n: int, field: str) -> None:
        limit = self.max_prompt_chars
        if limit is not None and n > limit:
            per_token = limit // self.max_model_len
            raise RequestError(field, f"has {n} characters, so at least {-(-n // per_token)} tokens: longer "
                                      f"than max_model_len={self.max_model_len}")

    def _check_tokens(self, n: int, field: str) -> None:
        """Too many tokens, found before any O(n) work on the loop (``validate_request`` would say the same)."""
        if n > self.max_model_len:
            raise RequestError(field, f"has {n} tokens, longer than max_model_len={self.max_model_len}")

    async def _text(self, text: str, special: bool, field: str) -> list[int]:
        if not text:
            raise RequestError(field, "must not be empty")
        tok = self._need_tokenizer(field)
        self._check_chars(len(text), field)
        if len(text) <= self.inline_chars:
            ids = tok.encode(text, special)
        else:
            ids = (await self._off_loop(tok.encode_batch, [text], special))[0]
        self._check_tokens(len(ids), field)
        return ids

    async def _segmented(self, sp: SegmentedPrompt) -> PromptIds:
        given = [name for name in ("segments", "separator") if getattr(sp, name) is not None]
        if len(given) != 1:
            raise RequestError("blend", f"give exactly one of segments or separator, got {given or 'none'}")
        if sp.segments is not None and len(sp.segments) > MAX_BLEND_SEGMENTS:  # before any rendering
            raise RequestError("blend.segments", f"must hold at most {MAX_BLEND_SEGMENTS} segments, "
                                                 f"got {len(sp.segments)}")
        field = "messages" if isinstance(sp.prompt, ChatPrompt) else "prompt"
        if isinstance(sp.prompt, ChatPrompt):
            text, special = self.render(sp.prompt)
        elif isinstance(sp.prompt, str):
            self._need_tokenizer(f"blend.{given[0]}")
            text, special = sp.prompt, True
        else:
            raise RequestError(f"blend.{given[0]}", "needs a text prompt (for token ids, give blend.spans)")
        self._check_chars(len(text), field)
        try:
            pieces = (segment_pieces(text, sp.segments) if sp.segments is not None
                      else separator_pieces(text, sp.separator or ""))
        except SegmentError as e:
            raise RequestError(e.field, str(e)) from None
        tok = self.tokenizer
        assert tok is not None
        if sum(len(p) for p, _ in pieces) <= self.inline_chars:
            ids, spans = join_pieces(pieces, encode_pieces(tok, pieces, special))
        else:
            ids, spans = await self._off_loop(lambda: join_pieces(pieces, encode_pieces(tok, pieces, special,
                                                                                        batch=True)))
        self._check_tokens(len(ids), field)
        return PromptIds(ids, spans)

    async def _off_loop(self, fn: Callable[..., _T], *args: object) -> _T:
        if self._workers is None:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # see the module's docstring
            self._workers = ThreadPoolExecutor(self.max_workers, thread_name_prefix="kvstrata-tokenize",
                                               initializer=_lower_priority)
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn, *args)


def _lower_priority() -> None:
    """This thread's CPU priority to ``WORKER_NICE`` (Linux sets it per thread; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
        except OSError:
            pass


def _content(message: object) -> object:
    return message.get("content") if isinstance(message, Mapping) else getattr(message, "content", None)
