"""Builders shared by the HTTP server tests: a checkpoint directory with a
real byte-level BPE tokenizer (trained here, in well under a second) for
the null executor, and an engine + HTTP server on their own event loop in a
thread (so a test can drive it with blocking clients, and measure it from
its own loop)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvstrata.api_server.server import OpenAIServer, run_http_server
from kvstrata.ipc.addresses import free_port
from kvstrata.worker.null_runner import NullModelRunner

WORDS = ("the river runs north past the old mill where bread is baked at dawn and the capital "
         "keeps its records in stone towers while merchants trade salt wool and copper").split()


def text_of(num_chars: int, seed: int = 0) -> str:
    """English-like text of exactly ``num_chars`` characters (deterministic)."""
    out: list[str] = []
    n, i = 0, seed
    while n < num_chars:
        w = WORDS[(i * 7 + i // 5) % len(WORDS)]
        out.append(w)
        n += len(w) + 1
        i += 1
    return " ".join(out)[:num_chars]


def write_bpe_checkpoint(directory: Path, *, vocab_size: int = 512, max_position_embeddings: int = 32768,
                         generation_config: dict[str, Any] | None = None) -> Path:
    """config.json (the default model's shape) + a byte-level BPE tokenizer.json
    with ``<s>``/``</s>`` (ids 0 and 1), as a checkpoint the null executor serves."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from kvstrata.worker.model.default_model import DEFAULT_MODEL_CONFIG

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text_of(2000, seed) for seed in range(20)], trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    config = {**DEFAULT_MODEL_CONFIG, "vocab_size": vocab_size, "max_position_embeddings": max_position_embeddings,
              "bos_token_id": 0, "eos_token_id": 1}
    (directory / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    return directory


class PacedRunner(NullModelRunner):
    """The null runner, each step taking ``step_s`` (asleep: no CPU, no GIL)."""

    def __init__(self, *args: Any, step_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_s = step_s

    def execute_model(self, scheduler_output):  # type: ignore[no-untyped-def]
        time.sleep(self.step_s)
        return super().execute_model(scheduler_output)


class ServerThread:
    """An engine and its HTTP server on their own event loop in a thread.
    ``start(make_engine)``: ``make_engine()`` is awaited on that loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="test-server-loop")
        self.port = free_port()
        self.engine: Any = None
        self.http: OpenAIServer | None = None
        self._runner: Any = None

    def call(self, coro: Awaitable[Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)  # type: ignore[arg-type]

    def start(self, make_engine: Callable[[], Awaitable[Any]], **server_kwargs: Any) -> "ServerThread":
        self.thread.start()

        async def up() -> None:
            self.engine = await make_engine()
            self.http = OpenAIServer(self.engine, **server_kwargs)
            self._runner = await run_http_server(self.http, "127.0.0.1", self.port)

        self.call(up())
        return self

    def stop(self) -> None:
        async def down() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
            if self.engine is not None:
                await self.engine.aclose()

        try:
            self.call(down())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
