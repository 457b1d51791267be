"""A GGUF file's tokenizer, built from its metadata (``tokenizer.ggml.*``):
byte-level BPE ("gpt2" model) from the token list and merges, control tokens
as special added tokens, the BOS/EOS ids, and the chat template
(``tokenizer.chat_template``). The result tokenizes as transformers'
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` does; ``kvstrata.text.tokenizer``
wraps it as an ``HFTokenizer``.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from kvstrata.text.chat import ChatTemplate

_CONTROL = 3  # llama.cpp token type: control (special) token


class GGUFTokenizerParts(NamedTuple):
    tokenizer: Tokenizer
    eos_token_id: int | None
    bos_token_id: int | None
    chat_template: ChatTemplate | None


def read_gguf_tokenizer(path: str | Path) -> GGUFTokenizerParts:
    """The tokenizer, special ids and chat template a GGUF's metadata describe."""
    import gguf

    path = Path(path).expanduser()
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - a bad file: name it
        raise ValueError(f"tokenizer: {str(path)!r} is not a readable GGUF file: {type(e).__name__}: {e}") from None

    def field(key: str):
        f = reader.fields.get(key)
        if f is None:
            return None
        if f.types[0].name == "ARRAY":
            if len(f.types) > 1 and f.types[1].name == "STRING":
                return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
            return [f.parts[i].tolist()[0] for i in f.data]
        if f.types[0].name == "STRING":
            return bytes(f.parts[f.data[0]]).decode("utf-8")
        return f.parts[f.data[0]].tolist()[0]

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"tokenizer: {path.name!r}: GGUF tokenizer model {kind!r} is not supported (only 'gpt2', "
                         "byte-level BPE)")
    tokens, merges = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ValueError(f"tokenizer: {path.name!r} has no token list or merges in its metadata")
    types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
    tok.add_special_tokens(special)
    bos, eos = field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")
    template_text = field("tokenizer.chat_template")
    template = None
    if isinstance(template_text, str) and template_text.strip():
        template = ChatTemplate(template_text, f"{path.name} (tokenizer.chat_template)",
                                bos_token=tokens[bos] if bos is not None else "",
                                eos_token=tokens[eos] if eos is not None else "")
    return GGUFTokenizerParts(tok, eos, bos, template)
