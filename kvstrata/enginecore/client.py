"""EngineClient: the one API every engine transport offers, in process
(``AsyncEngine``) or over ZMQ to the engine subprocess
(``kvstrata.ipc.mp_client.MPEngineClient``). The HTTP server, the CLI and
the load tests type the engine as an ``EngineClient`` and call nothing else.

    async with await open_engine(config, "ipc") as engine:       # kvstrata.ipc.engines
        async for out in engine.generate("Hello", SamplingParams(max_tokens=8)):
            print(out.text_delta, end="")

``generate`` takes a ``kvstrata.text.prompts.Prompt`` (text, token ids, a
conversation, blend segments); the client tokenizes, checks the request
once, detokenizes and applies stop strings (``kvstrata.enginecore.processing``);
the engine core sees ids only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncGenerator, Sequence
from typing import Protocol, Self, TypedDict, Unpack

from kvstrata.config import EngineConfig
from kvstrata.text.prompts import ChatPrompt, Prompt
from kvstrata.text.tokenizer import Tokenizer
from kvstrata.types import EngineHealth, EngineStats, RequestOutput, SamplingParams


class GenerateOptions(TypedDict, total=False):
    """``EngineClient.generate``'s keyword arguments, as ``chat`` passes them on."""

    request_id: str | None
    priority: int
    cache_salt: str | None
    lora_name: str | None
    session_key: str | None


class EngineClient(Protocol):
    """A running engine as its callers see it.

    Errors: ``RequestError`` (a ValueError naming the field; nothing was
    queued), ``EngineOverloadedError`` (retry later), ``EngineDeadError``
    (the engine stopped: every pending and later call gets it).
    """

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration (for a client that connected to a
        running engine: as the engine's handshake told it)."""
        ...

    @property
    def model_name(self) -> str:
        """The model's name as the OpenAI API shows it (``served_model_name``)."""
        ...

    @property
    def max_model_len(self) -> int:
        """The longest context (prompt + output) the engine takes, after
        capping by its KV pool."""
        ...

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None: prompts and outputs are token ids only)."""
        ...

    @property
    def is_dead(self) -> bool:
        """True once the engine stopped (closed, crashed, unreachable)."""
        ...

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        session_key: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's deltas; the last has ``finished=True``.
        Leaving the iteration early (``aclose()``, or being cancelled) aborts
        the request. Bad input raises RequestError at the first ``anext``.
        ``session_key`` (the OpenAI ``user`` field): a fleet routes one
        conversation's requests by it; a single engine has nothing to route
        and ignores it."""
        ...

    def chat(
        self,
        messages: Sequence[object],
        params: SamplingParams | None = None,
        **kwargs: Unpack[GenerateOptions],
    ) -> AsyncGenerator[RequestOutput, None]:
        """``generate`` on a conversation (``{"role", "content"}`` dicts or
        objects), rendered with the model's chat template (or the plain
        format for a checkpoint without one). Implementations call
        ``generate_chat``; bad messages raise RequestError naming the field
        at the first ``anext``."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a live request; a no-op for unknown or finished ids."""
        ...

    async def stats(self) -> EngineStats: ...

    async def reset_prefix_cache(self) -> bool:
        """Drop the device prefix cache; False (nothing changed) while blocks are in use."""
        ...

    async def flush_kv(self, timeout_s: float = 60.0) -> None:
        """Wait until every KV transfer started so far is done (loads landed,
        saves taken, every store write on every tier)."""
        ...

    async def is_healthy(self) -> bool:
        """True when the engine serves; False while it is still starting or
        when it is stalled; raises EngineDeadError once it is dead."""
        ...

    async def check_health(self) -> EngineHealth:
        """What ``is_healthy`` decides from; raises EngineDeadError once dead."""
        ...

    async def aclose(self) -> None:
        """Abort this client's requests and release everything it holds. Idempotent."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc_info: object) -> None: ...


def served_model_name(config: EngineConfig) -> str:
    """The model's name for the API: its checkpoint directory's (or GGUF
    file's, without ``.gguf``) name, or ``kvstrata-default`` for the
    built-in random model."""
    m = config.model.model
    if not m:
        return "kvstrata-default"
    name = os.path.basename(os.path.normpath(m))
    return name[:-5] if name.lower().endswith(".gguf") else name


async def generate_chat(client: EngineClient, messages: Sequence[object], params: SamplingParams | None = None,
                        **kwargs: Unpack[GenerateOptions]) -> AsyncGenerator[RequestOutput, None]:
    """What every ``EngineClient.chat`` does: ``generate`` on a ``ChatPrompt``
    (rendered and tokenized by the client's one text path)."""
    async with contextlib.aclosing(client.generate(ChatPrompt(messages=list(messages)), params, **kwargs)) as agen:
        async for out in agen:
            yield out
