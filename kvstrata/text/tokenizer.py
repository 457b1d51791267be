"""Tokenizers: a checkpoint's ``tokenizer.json`` through the ``tokenizers``
package, or a byte-level tokenizer when there is none.

Both offer the same small surface: ``encode``, ``decode``, their batch
forms ``encode_batch`` / ``decode_batch`` (the Hugging Face ones release the
GIL: ``kvstrata.text.prompts`` runs them in a worker thread for long
inputs), ``convert_ids_to_tokens``, ``eos_token_id``,
``eos_token_ids`` (every id that ends a reply: the tokenizer's EOS token,
config.json's and generation_config.json's ``eos_token_id``, an int or a
list in either; for a GGUF its EOS, end-of-turn and end-of-message ids),
``bos_token_id``, ``vocab_size``, ``all_special_ids``,
``decode_stream(prompt_token_ids)``, an incremental decoder whose
``step(token_id)`` returns only complete text (never half a UTF-8 character)
that the ``IncrementalDetokenizer`` builds on, and two facts of the checkpoint:

- ``max_token_chars``: the most characters of input one token can stand for
  (None when no bound is sound: a normalizer or pre-tokenizer that drops
  characters, unknown characters fused into one token). A text of more than
  ``max_model_len * max_token_chars`` characters cannot fit the context,
  which is known before tokenizing it.
- ``generation_defaults``: the sampling defaults the checkpoint's
  generation_config.json (or a GGUF's ``general.sampling.*``) sets
  (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``max_tokens`` from
  ``max_new_tokens``), as vLLM reads them, for requests that leave them unset.

Byte-level ids: 0..255 are the bytes, 256 is BOS, 257 is EOS (vocab 258).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import structlog
from tokenizers import Tokenizer as _HFTokenizerImpl
from tokenizers.decoders import DecodeStream

from kvstrata.text.chat import ChatTemplate, load_chat_template
from kvstrata.text.gguf_tokenizer import GGUFMetadata, read_gguf_tokenizer
from kvstrata.config import ModelConfig
from kvstrata.types import SamplingParams

log = structlog.get_logger(__name__)

BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_VOCAB_SIZE = 258

# DecodeStream needs a few prompt tokens of context (a SentencePiece "▁word"
# decodes differently at the start of a text than after other text).
_PROMPT_CONTEXT_TOKENS = 6


class TokenStream(Protocol):
    def step(self, token_id: int) -> str: ...


NO_DEFAULTS: Mapping[str, float | int] = MappingProxyType({})


class Tokenizer(Protocol):
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: ChatTemplate | None
    bos_token_id: int | None
    vocab_size: int
    all_special_ids: frozenset[int]
    max_token_chars: int | None
    generation_defaults: Mapping[str, float | int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def decode_batch(self, seqs: list[list[int]], skip_special_tokens: bool = True) -> list[str]: ...
    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]: ...
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

    __slots__ = ("generation_defaults",)
    chat_template = None  # no template: the plain chat format
    eos_token_id: int | None = BYTE_EOS_ID
    eos_token_ids: tuple[int, ...] = (BYTE_EOS_ID,)
    bos_token_id: int | None = BYTE_BOS_ID
    vocab_size: int = BYTE_VOCAB_SIZE
    all_special_ids: frozenset[int] = frozenset((BYTE_BOS_ID, BYTE_EOS_ID))
    max_token_chars: int | None = 1  # a character is at least one byte

    def __init__(self, *, generation_defaults: Mapping[str, float | int] = NO_DEFAULTS) -> None:
        self.generation_defaults = generation_defaults

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BYTE_BOS_ID, *ids] if add_special_tokens else ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(t for t in token_ids if 0 <= t < 256)
        return data.decode("utf-8", errors="replace")

    def decode_batch(self, seqs: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(s, skip_special_tokens) for s in seqs]

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        """A printable ASCII byte as itself, other bytes as ``<0xNN>``, BOS/EOS as ``<s>``/``</s>``."""
        names = {BYTE_BOS_ID: "<s>", BYTE_EOS_ID: "</s>"}
        return [chr(t) if 32 <= t < 127 else f"<0x{t:02X}>" if 0 <= t < 256 else names.get(t, f"<{t}>")
                for t in token_ids]

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
                 "chat_template", "max_token_chars", "generation_defaults")

    def __init__(self, directory: Path | None = None, *, tokenizer: _HFTokenizerImpl | None = None,
                 eos_token_id: int | None = None, bos_token_id: int | None = None,
                 chat_template: ChatTemplate | None = None, eos_token_ids: tuple[int, ...] = (),
                 generation_defaults: Mapping[str, float | int] = NO_DEFAULTS) -> None:
        """From a checkpoint ``directory`` (tokenizer.json and its configs), or
        from a built ``tokenizer`` and its special ids (a GGUF's metadata)."""
        if directory is None:
            assert tokenizer is not None, "a directory or a tokenizer"
            self._tok = tokenizer
            self.chat_template = chat_template
            self.eos_token_id, self.bos_token_id = eos_token_id, bos_token_id
            ends: list[int] = list(eos_token_ids)
            self.generation_defaults = generation_defaults
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
            self.generation_defaults = sampling_defaults_in(
                configs["generation_config.json"], GENERATION_CONFIG_KEYS, str(directory / "generation_config.json"))
        self.eos_token_ids = tuple(dict.fromkeys(
            [self.eos_token_id, *ends] if self.eos_token_id is not None else ends))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()
        self.all_special_ids = frozenset(i for i, t in added.items() if t.special)
        self.max_token_chars = token_char_bound(self._tok)

    def _special_id(self, token: object, fallback: object) -> int | None:
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

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of each text, with the GIL released while tokenizing
        (``encode`` holds it: a long text would stop every other thread)."""
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [t for t in token_ids if 0 <= t < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, seqs: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """``decode`` of each sequence, with the GIL released while decoding."""
        n = self.vocab_size
        return self._tok.decode_batch([[t for t in s if 0 <= t < n] for s in seqs],
                                      skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        """The vocabulary's spelling of each id (``Ġthe``), as transformers'."""
        tok = self._tok
        return [tok.id_to_token(t) or "" for t in token_ids]

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
        beside = Path(path).expanduser().parent / "generation_config.json"  # overrides the GGUF's own
        defaults = {**sampling_defaults_in(parts.metadata_sampling, GGUF_SAMPLING_KEYS, str(path)),
                    **sampling_defaults_in(_read_json(beside), GENERATION_CONFIG_KEYS, str(beside))}
        return HFTokenizer(tokenizer=parts.tokenizer, eos_token_id=parts.eos_token_id,
                           bos_token_id=parts.bos_token_id, chat_template=parts.chat_template,
                           eos_token_ids=parts.eos_token_ids, generation_defaults=MappingProxyType(defaults))
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ValueError(f"tokenizer: {str(directory)!r} is not a directory")
    if (directory / "tokenizer.json").is_file():
        return HFTokenizer(directory)
    gen = directory / "generation_config.json"
    return ByteTokenizer(generation_defaults=sampling_defaults_in(_read_json(gen), GENERATION_CONFIG_KEYS, str(gen)))


def eos_ids_in(cfg: Mapping[str, object], where: str) -> tuple[int, ...]:
    """``eos_token_id`` of a config.json / generation_config.json: absent, an
    int or a list of ints; anything else is a ValueError naming ``where``.
    The one parser of it (the checkpoint loader uses it too)."""
    eos = cfg.get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(type(i) is int and i >= 0 for i in ids):
        raise ValueError(f"{where}: eos_token_id must be a non-negative int or a list of them, got {eos!r}")
    return tuple(ids)


# generation_config.json keys -> the SamplingParams field they default (vLLM's
# ``--generation-config auto`` reads the same ones; ``do_sample`` is ignored, as there).
GENERATION_CONFIG_KEYS: Mapping[str, str] = MappingProxyType({
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "max_new_tokens": "max_tokens"})
# A GGUF's sampling metadata (llama.cpp's ``general.sampling.*``) -> SamplingParams field.
GGUF_SAMPLING_KEYS: Mapping[str, str] = MappingProxyType({
    "general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p"})
_INT_FIELDS = ("top_k", "max_tokens")


def sampling_defaults_in(cfg: Mapping[str, object], keys: Mapping[str, str], where: str) -> Mapping[str, float | int]:
    """The SamplingParams defaults ``cfg`` sets, by ``keys`` (config key ->
    field). A value a request could not carry (not a number, out of range)
    is left out, with a warning naming ``where``."""
    out: dict[str, float | int] = {}
    for key, field in keys.items():
        value = cfg.get(key)
        if value is None:
            continue
        if field in _INT_FIELDS and isinstance(value, float) and value.is_integer():
            value = int(value)
        try:
            if isinstance(value, bool) or not isinstance(value, int if field in _INT_FIELDS else (int, float)):
                raise TypeError(f"{field} must be a number")
            SamplingParams(**{field: value}).validate()
        except (TypeError, ValueError) as e:
            log.warning("generation_default_ignored", where=where, key=key, value=repr(value)[:100], reason=str(e))
            continue
        out[field] = value
    return MappingProxyType(out)


# Normalizers and pre-tokenizers that never drop input characters (a
# composing normalizer shrinks text by at most 4: the longest canonical
# decomposition); anything else makes ``max_token_chars`` unknowable.
_KEEPS_CHARS = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "ByteLevel": 1, "NFC": 4, "NFKC": 4,
                "Metaspace": 1, "Digits": 1, "Punctuation": 1, "UnicodeScripts": 1}


def token_char_bound(tok: _HFTokenizerImpl) -> int | None:
    """The most input characters one token of ``tok`` can stand for, times
    what its normalizer can shrink text by; None when no bound is sound.

    A vocabulary entry spells what its token covers: byte-level entries one
    character per byte (a character is at least one byte), SentencePiece
    ones character for character (byte-fallback entries ``<0xAB>`` cover
    one byte with six). Unknown characters fused into one token, WordPiece's
    whole-word ``[UNK]`` or a splitter that removes what it splits on leave
    no bound."""
    model = tok.model
    kind = type(model).__name__
    if kind == "BPE":
        if model.unk_token is not None and model.fuse_unk and not model.byte_fallback:
            return None
    elif kind == "Unigram":
        if not json.loads(model.__getstate__()).get("byte_fallback", False):
            return None
    else:  # WordPiece, WordLevel: a whole unknown word is one token
        return None
    factor = 1
    for part in (tok.normalizer, tok.pre_tokenizer):
        if part is not None:
            f = _shrink_factor(json.loads(part.__getstate__()))
            if f is None:
                return None
            factor *= f
    longest = max(map(len, tok.get_vocab(with_added_tokens=True)), default=1)
    return max(longest, 1) * factor


def _shrink_factor(spec: dict[str, Any]) -> int | None:  # Any: a tokenizer.json component
    kind = spec.get("type")
    if kind == "Sequence":
        factors = [_shrink_factor(s) for s in spec.get("normalizers") or spec.get("pretokenizers") or []]
        if any(f is None for f in factors):
            return None
        out = 1
        for f in factors:
            out *= f  # type: ignore[operator]
        return out
    if kind == "Replace":  # a literal string replaced by one at least as long keeps every character
        pattern = spec.get("pattern") or {}
        return 1 if "String" in pattern and len(spec.get("content", "")) >= len(pattern["String"]) else None
    if kind == "Split":
        return None if spec.get("behavior") == "Removed" else 1
    return _KEEPS_CHARS.get(kind)  # type: ignore[arg-type]


def _read_json(path: Path) -> dict[str, object]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer: cannot read {str(path)!r}: {exc}") from exc
    return data if isinstance(data, dict) else {}
