"""A GGUF file's tokenizer, built from its metadata (``tokenizer.ggml.*``)
with the ``tokenizers`` package: byte-level BPE ("gpt2" model) from the token
list and merges, split the way ``tokenizer.ggml.pre`` names (Llama 3's digit
triples, Qwen2's single digits, else GPT-2's pattern), control tokens (type
3) as special added tokens, user-defined ones (type 4, e.g. ``<think>``) as
plain added tokens matched whole, BOS/EOS added when ``add_bos_token`` /
``add_eos_token`` say so, the special ids (EOS plus end-of-turn ``eot`` and
end-of-message ``eom``), and the chat template (``tokenizer.chat_template``).

The result tokenizes as transformers'
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` does (tested);
``kvstrata.text.tokenizer`` wraps it as an ``HFTokenizer``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from kvstrata.text.chat import ChatTemplate

if TYPE_CHECKING:
    import gguf

# Any: a metadata value as the file holds it (a string, a number, a bool or a
# list of them), used as read; every reader checks the keys it needs.
GGUFValue: TypeAlias = Any

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
# llama.cpp's recommended sampling, when the file carries it
_SAMPLING_KEYS = ("general.sampling.temp", "general.sampling.top_p", "general.sampling.top_k",
                  "general.sampling.min_p")

# tokenizer.ggml.pre -> the split pattern its merges were learned with
# (None: GPT-2's, which ByteLevel applies itself).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


class GGUFTokenizerParts(NamedTuple):
    tokenizer: Tokenizer
    eos_token_id: int | None
    bos_token_id: int | None
    chat_template: ChatTemplate | None
    eos_token_ids: tuple[int, ...] = ()  # EOS, end-of-turn, end-of-message: every id that ends a reply
    metadata_sampling: dict[str, object] = {}  # the file's ``general.sampling.*`` (llama.cpp's sampling defaults)


def read_gguf_tokenizer(path: str | Path, metadata: GGUFMetadata | None = None) -> GGUFTokenizerParts:
    """The tokenizer, special ids and chat template a GGUF's metadata
    describe; ``metadata``: the file's, already read (opening a large GGUF
    parses every string in it: seconds)."""
    path = Path(path).expanduser()
    meta = metadata if metadata is not None else _open_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"tokenizer: {path.name!r}: GGUF tokenizer model {kind!r} is not supported (only 'gpt2', "
                         "byte-level BPE)")
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ValueError(f"tokenizer: {path.name!r} has no token list or merges in its metadata")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok = _byte_level_bpe(tokens, merges, types, meta.get("tokenizer.ggml.pre"))
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    _add_bos_eos(tok, tokens, bos if meta.get("tokenizer.ggml.add_bos_token") else None,
                 eos if meta.get("tokenizer.ggml.add_eos_token") else None)
    ends = (eos, meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id"))
    template_text = meta.get("tokenizer.chat_template")
    template = None
    if isinstance(template_text, str) and template_text.strip():
        template = ChatTemplate(template_text, f"{path.name} (tokenizer.chat_template)",
                                bos_token=tokens[bos] if bos is not None else "",
                                eos_token=tokens[eos] if eos is not None else "")
    return GGUFTokenizerParts(tok, eos, bos, template, tuple(dict.fromkeys(int(t) for t in ends if t is not None)),
                              {k: v for k in _SAMPLING_KEYS if (v := meta.get(k)) is not None})


def _open_metadata(path: Path) -> GGUFMetadata:
    import gguf

    try:
        return GGUFMetadata(gguf.GGUFReader(str(path)))
    except Exception as e:  # noqa: BLE001 - a bad file: name it
        raise ValueError(f"tokenizer: {str(path)!r} is not a readable GGUF file: {type(e).__name__}: {e}") from None


class GGUFMetadata:
    """Owns: a GGUF reader's fields, read as plain Python values (strings,
    numbers, lists of either). The one reader of GGUF metadata: the
    tokenizer here and the checkpoint reader (``kvstrata.worker.model.gguf_file``)."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: GGUFValue = None) -> GGUFValue:
        f = self._fields.get(key)
        if f is None:
            return default
        if f.types[0].name == "ARRAY":
            if len(f.types) > 1 and f.types[1].name == "STRING":
                return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
            return [f.parts[i].tolist()[0] for i in f.data]
        if f.types[0].name == "STRING":
            return bytes(f.parts[f.data[0]]).decode("utf-8")
        return f.parts[f.data[0]].tolist()[0]


def _byte_level_bpe(tokens: list[str], merges: list[str], types: list[int], pre: str | None) -> Tokenizer:
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    # A vocabulary entry written with characters outside the byte alphabet
    # (a mislabelled raw string) is respelled byte by byte, as transformers does.
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    split = _SPLITS.get(pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a converter's
    # mislabel; adding it would grow the vocabulary past the model's.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet])
    # User-defined tokens (<think>) are matched whole, as llama.cpp does, but are not special.
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])
    return tok


def _add_bos_eos(tok: Tokenizer, tokens: list[str], bos: int | None, eos: int | None) -> None:
    """BOS before / EOS after every encoded text (``add_special_tokens=True``)."""
    if bos is None and eos is None:
        return
    specials = list(dict.fromkeys((tokens[i], i) for i in (bos, eos) if i is not None))

    def seq(name: str, type_id: int) -> str:
        parts = [f"{tokens[bos]}:{type_id}"] if bos is not None else []
        parts.append(f"${name}:{type_id}")
        return " ".join(parts + ([f"{tokens[eos]}:{type_id}"] if eos is not None else []))

    tok.post_processor = processors.TemplateProcessing(single=seq("A", 0), pair=f"{seq('A', 0)} {seq('B', 1)}",
                                                       special_tokens=specials)


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand
    for themselves, the others (controls, space, ...) for chr(256 + n) in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out
