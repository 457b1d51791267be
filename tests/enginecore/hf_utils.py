"""Builders for tiny random Hugging Face Llama checkpoints (the test oracle)
and for small tokenizer.json files.

``build_tiny_llama(dir, ...)`` saves a random ``transformers.LlamaForCausalLM``
as safetensors into ``dir`` and returns the fp32 model (eager attention) for
comparing logits and greedy ``generate`` output with kvstrata.

The weights use a wide init (std 0.15 instead of HF's 0.02) so the logits
of a tiny model are well separated: greedy argmax then practically never hinges on a
last-bit tie between two implementations' float rounding.

Token ids 256 / 257 are BOS / EOS, matching kvstrata's byte-level tokenizer
(these checkpoints have no tokenizer.json), so an EOS stops HF ``generate``
and kvstrata alike. ``hf_greedy`` is the oracle for greedy token ids.

``write_bytelevel_bpe_tokenizer`` / ``write_sentencepiece_byte_fallback_tokenizer``
write a tokenizer.json (+ tokenizer_config.json) into a directory, e.g. next
to a tiny checkpoint; they are built in-process, nothing is downloaded.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=None,
    tie_word_embeddings=False,
    initializer_range=0.15,
)


def tiny_llama_config(**overrides: Any) -> LlamaConfig:
    cfg = LlamaConfig(**{**TINY_DEFAULTS, **overrides})
    cfg._attn_implementation = "eager"
    return cfg


def build_tiny_llama(
    directory: str | Path,
    *,
    seed: int = 0,
    save_dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **config_overrides: Any,
) -> LlamaForCausalLM:
    """Save a random tiny Llama into ``directory``; return it in fp32, eval mode.

    When ``save_dtype`` is lower precision, the returned fp32 model holds the
    rounded weights (as saved), so it is the exact oracle for the checkpoint.
    """
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**config_overrides)).eval()
    with torch.no_grad():  # HF leaves norm weights at 1; vary them so a missed norm shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
        for param in model.parameters():  # the oracle holds the weights as saved
            param.copy_(param.to(save_dtype))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    # Save a cast copy: casting the oracle itself would round its RoPE buffer too.
    copy.deepcopy(model).to(save_dtype).save_pretrained(str(directory), **kwargs)
    return model


def hf_greedy(model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF ``generate`` greedy continuation of ``prompt`` (new tokens only; stops at EOS)."""
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            pad_token_id=model.config.eos_token_id,
        )
    return out[0, len(prompt):].tolist()


def hf_logits(model: LlamaForCausalLM, prompt: list[int]) -> torch.Tensor:
    """fp32 logits [len(prompt), vocab] of one full forward."""
    with torch.no_grad():
        return model(torch.tensor([prompt], dtype=torch.long)).logits[0].float()


# --- tokenizers (tokenizer.json written in a checkpoint directory) ---------

_TRAIN_TEXT = [
    "hello world, the quick brown fox jumps over the lazy dog. STOP here",
    "héllo wörld ça va? naïve café — «quotes» 日本語のテキスト 😀 emoji ok",
]


def write_bytelevel_bpe_tokenizer(directory: str | Path, vocab_size: int = 400) -> None:
    """A GPT-2 / Llama-3 style byte-level BPE (specials <s>=0, </s>=1), with
    tokenizer_config.json naming the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TRAIN_TEXT * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    _save(tok, directory, bos="<s>", eos="</s>")


def write_sentencepiece_byte_fallback_tokenizer(directory: str | Path) -> None:
    """A Llama-2 style tokenizer: "▁" for spaces, ASCII letters as pieces and
    every other character as its UTF-8 bytes (<0xE6> ...), so a multi-byte
    character spans several tokens. Specials <unk>=0, <s>=1, </s>=2."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?", "▁the", "he", "ll", "llo"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("h", "e"), ("l", "l"), ("ll", "o"), ("▁", "t"), ("▁t", "he")]
    vocab.setdefault("▁t", len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    _save(tok, directory, bos="<s>", eos="</s>")


def _save(tok, directory: str | Path, bos: str, eos: str) -> None:
    import json

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": {"content": eos}}))


def build_tiny_family(directory: str | Path, family: str, *, seed: int = 0, save_dtype: torch.dtype = torch.float32,
                      max_shard_size: str | None = None, **overrides: Any):
    """A random tiny checkpoint of ``family`` ("llama", "qwen2": q/k/v biases,
    "qwen2-yarn", "qwen3": q/k norms, explicit head_dim, tied embeddings,
    "mistral": an 8-token sliding window) saved into ``directory`` in
    ``save_dtype`` (sharded with ``max_shard_size``); returns the HF model
    (fp32, eval, holding the weights as saved) as the oracle."""
    import transformers

    if family == "llama":
        return build_tiny_llama(directory, seed=seed, save_dtype=save_dtype, max_shard_size=max_shard_size,
                                **overrides)
    base = {**TINY_DEFAULTS, **overrides}
    if family in ("qwen2", "qwen2-yarn", "qwen2-sw"):
        if family == "qwen2-yarn":  # Qwen2.5's long-context setting, scaled down
            base["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
        # qwen2-sw: layer 0 full attention, layer 1 an 8-token window (two KV cache groups)
        sw = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1) if family == "qwen2-sw" else \
            dict(use_sliding_window=False)
        cfg = transformers.Qwen2Config(**base, **sw)
        cls = transformers.Qwen2ForCausalLM
    elif family == "mistral":  # a window (8) shorter than most prompts; blocks of 4
        cfg = transformers.MistralConfig(**base, sliding_window=8)
        cls = transformers.MistralForCausalLM
    elif family == "qwen3":
        base.update(head_dim=24, tie_word_embeddings=True)  # head_dim != hidden / heads (16)
        cfg = transformers.Qwen3Config(**base, use_sliding_window=False)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0, 0.3)  # HF zero-inits biases: make a missed bias show
        for param in model.parameters():  # the oracle holds the weights as saved
            param.copy_(param.to(save_dtype))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    copy.deepcopy(model).to(save_dtype).save_pretrained(str(directory), **kwargs)
    return model
