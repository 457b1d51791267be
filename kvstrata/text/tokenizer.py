"""Tokenizers: a checkpoint's ``tokenizer.json`` through the ``tokenizers``
package, or a byte-level tokenizer when there is none.

Both offer the same small surface: ``encode``, ``decode``, ``eos_token_id``,
``eos_token_ids`` (every id that ends a reply: the tokenizer's EOS token,
config.json's and generation_config.json's ``eos_token_id``, an int or a
list in either; for a GGUF its EOS, end-of-turn and end-of-message ids),
``bos_token_id``, ``vocab_size``, ``all_special_ids`` and
``decode_stream(prompt_token_ids)``, an incremental decoder whose
``step(token_id)`` returns only complete text (never half a UTF-8 character)
that the ``IncrementalDetokenizer`` builds on.

Byte-level ids: 0..255 are the bytes, 256 is BOS, 257 is EOS (vocab 258).
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer as _HFTokenizerImpl
from tokenizers.decoders import DecodeStream

from kvstrata.text.chat import ChatTemplate, load_chat_template
from kvstrata.text.gguf_tokenizer import GGUFMetadata, read_gguf_tokenizer
from kvstrata.config import ModelConfig

BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_VOCAB_SIZE = 258

# DecodeStream needs a few prompt tokens of context (a SentencePiece "▁word"
# decodes differently at the start of a text than after other text).
_PROMPT_CONTEXT_TOKENS = 6


class TokenStream(Protocol):
    def step(self, token_id: int) -> str: ...


class Tokenizer(Protocol):
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: ChatTemplate | None
    bos_token_id: int | None
    vocab_size: int
    all_special_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def decode_stream(self, prompt_token_ids: list[int]) -> TokenStream: ...


class _ByteStream:
    """Owns: an incremental UTF-8 decoder (incomplete characters stay inside it)."""

    __slots__ = ("_decoder",)

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # A prompt given as ids may end inside a character: prime the decoder
        # with its last bytes (a UTF-8 character is at most 4) and drop the text.
        tail = bytes(t for t in prompt_token_ids[-3:] if 0 <= t < 256)
        self._decoder.decode(tail)

    def step(self, token_id: int) -> str:
        if 0 <= token_id < 256:
            return self._decoder.decode(token_id.to_bytes(1, "little"))
        return ""


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus BOS and EOS; ids outside 0..255 decode to nothing."""

    __slots__ = ()
    chat_template = None  # no template: the plain chat format
    eos_token_id: int | None = BYTE_EOS_ID
    eos_token_ids: tuple[int, ...] = (BYTE_EOS_ID,)
    bos_token_id: int | None = BYTE_BOS_ID
    vocab_size: int = BYTE_VOCAB_SIZE
    all_special_ids: frozenset[int] = frozenset((BYTE_BOS_ID, BYTE_EOS_ID))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BYTE_BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(t for t in token_ids if 0 <= t < 256)
        return data.decode("utf-8", errors="replace")

    def decode_stream(self, prompt_token_ids: list[int]) -> TokenStream:
        return _ByteStream(prompt_token_ids)


class _HFStream:
    """Owns: one ``tokenizers.DecodeStream``."""

    __slots__ = ("_stream", "_tokenizer", "_vocab_size")

    def __init__(self, tokenizer: _HFTokenizerImpl, vocab_size: int, prompt_token_ids: list[int]) -> None:
        context = [t for t in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:] if 0 <= t < vocab_size]
        self._stream = DecodeStream(ids=context, skip_special_tokens=True)
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size

    def step(self, token_id: int) -> str:
        # A model vocabulary padded past the tokenizer's can emit ids it cannot decode.
        if not 0 <= token_id < self._vocab_size:
            return ""
        return self._stream.step(self._tokenizer, token_id) or ""


class HFTokenizer:
    """A ``tokenizer.json`` (any model the ``tokenizers`` package reads); special
    tokens come from tokenizer_config.json, else config.json/generation_config.json."""

    __slots__ = ("_tok", "eos_token_id", "eos_token_ids", "bos_token_id", "vocab_size", "all_special_ids",
                 "chat_template")

    def __init__(self, directory: Path | None = None, *, tokenizer: _HFTokenizerImpl | None = None,
                 eos_token_id: int | None = None, bos_token_id: int | None = None,
                 chat_template: ChatTemplate | None = None, eos_token_ids: tuple[int, ...] = ()) -> None:
        """From a checkpoint ``directory`` (tokenizer.json and its configs), or
        from a built ``tokenizer`` and its special ids (a GGUF's metadata)."""
        if directory is None:
            assert tokenizer is not None, "a directory or a tokenizer"
            self._tok = tokenizer
            self.chat_template = chat_template
            self.eos_token_id, self.bos_token_id = eos_token_id, bos_token_id
            ends: list[int] = list(eos_token_ids)
        else:
            self.chat_template = load_chat_template(directory)  # None: the plain chat format
            self._tok = _HFTokenizerImpl.from_file(str(directory / "tokenizer.json"))
            tok_cfg = _read_json(directory / "tokenizer_config.json")
            configs = {name: _read_json(directory / name) for name in ("config.json", "generation_config.json")}
            model_cfg = {**configs["config.json"], **configs["generation_config.json"]}
            self.eos_token_id = self._special_id(tok_cfg.get("eos_token"), model_cfg.get("eos_token_id"))
            self.bos_token_id = self._special_id(tok_cfg.get("bos_token"), model_cfg.get("bos_token_id"))
            ends = [i for name, cfg in configs.items()
                    for i in eos_ids_in(cfg, f"tokenizer: {str(directory / name)!r}")]
        self.eos_token_ids = tuple(dict.fromkeys(
            [self.eos_token_id, *ends] if self.eos_token_id is not None else ends))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()
        self.all_special_ids = frozenset(i for i, t in added.items() if t.special)

    def _special_id(self, token: Any, fallback: Any) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        if isinstance(fallback, list):
            fallback = fallback[0] if fallback else None
        return fallback if isinstance(fallback, int) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [t for t in token_ids if 0 <= t < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, prompt_token_ids: list[int]) -> TokenStream:
        return _HFStream(self._tok, self.vocab_size, prompt_token_ids)


def load_model_tokenizer(model: ModelConfig) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of the model ``model`` names: ``model.tokenizer``, else the
    checkpoint directory's, else byte-level (the built-in model has none).
    The same one whether the engine's runner or a client loads it."""
    return load_tokenizer(model.tokenizer or model.model)


def load_tokenizer(path: str | None, *, gguf_metadata: GGUFMetadata | None = None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer in directory ``path`` (its tokenizer.json), or of a GGUF
    file (from its metadata), else byte-level.

    ``path`` None, or a directory without tokenizer.json, gives the byte-level
    tokenizer; a ``path`` that does not exist is an error.
    """
    if path is None:
        return ByteTokenizer()
    if str(path).lower().endswith(".gguf"):
        parts = read_gguf_tokenizer(path, gguf_metadata)
        return HFTokenizer(tokenizer=parts.tokenizer, eos_token_id=parts.eos_token_id,
                           bos_token_id=parts.bos_token_id, chat_template=parts.chat_template,
                           eos_token_ids=parts.eos_token_ids)
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ValueError(f"tokenizer: {str(directory)!r} is not a directory")
    if (directory / "tokenizer.json").is_file():
        return HFTokenizer(directory)
    return ByteTokenizer()


def eos_ids_in(cfg: dict[str, Any], where: str) -> tuple[int, ...]:
    """``eos_token_id`` of a config.json / generation_config.json: absent, an
    int or a list of ints; anything else is a ValueError naming ``where``.
    The one parser of it (the checkpoint loader uses it too)."""
    eos = cfg.get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(type(i) is int and i >= 0 for i in ids):
        raise ValueError(f"{where}: eos_token_id must be a non-negative int or a list of them, got {eos!r}")
    return tuple(ids)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer: cannot read {str(path)!r}: {exc}") from exc
    return data if isinstance(data, dict) else {}
