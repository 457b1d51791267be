"""What a GGUF's tokenizer metadata can say beyond SmolLM2's: the
pre-tokenizer split (``tokenizer.ggml.pre``: Qwen2 splits digits one by one,
Llama 3 in threes), user-defined tokens kept whole (``<think>``, token type
4), ``add_bos_token``, vocabulary entries spelled outside the byte alphabet.
Tiny GGUFs are written in the test with ``gguf.GGUFWriter``; the oracle is
transformers' ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``."""

from __future__ import annotations

import json

import pytest

from kvstrata.text.tokenizer import load_tokenizer

gguf = pytest.importorskip("gguf")

_TRAIN = [
    "hello world, the quick brown fox jumps over the lazy dog 12345 67890. STOP here I'm they'll",
    "héllo wörld ça va? naïve café — «quotes» 日本語のテキスト 😀 emoji ok\n\n  spaces   and\ttabs",
]
TEXTS = [
    "hello 1234567 world", "I'M they'll   go\n\n\n x", "日本語 😀 café", "<think>ok</think> done", "a<s>b</s>c",
    "  leading and trailing  ", "x=12;y=345\r\n", "", "<thinking>", "tab\t\ttab",
]
CONTROL, USER_DEFINED, NORMAL = 3, 4, 1


@pytest.fixture(scope="module")
def vocab():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>", "<|endoftext|>", "<think>", "</think>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TRAIN * 20, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def write_tokenizer_gguf(path, tokens, merges, *, pre, add_bos, add_eos=None, extra=()):
    """A GGUF holding only tokenizer metadata, as llama.cpp's converter writes it.
    (<|endoftext|> is in the vocabulary: transformers' GPT2Tokenizer adds it
    as its default unknown token when it is not.)"""
    tokens = [*tokens, *extra]
    types = [CONTROL if t in ("<s>", "</s>", "<|endoftext|>") else USER_DEFINED if "think>" in t else NORMAL for t in tokens]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("add_bos", [False, True], ids=["no-bos", "bos"])
@pytest.mark.parametrize("pre", ["default", "smollm", "qwen2", "llama-bpe"])
def test_ids_equal_transformers(tmp_path, vocab, pre, add_bos):
    from transformers import AutoTokenizer

    path = tmp_path / f"{pre}.gguf"
    write_tokenizer_gguf(path, *vocab, pre=pre, add_bos=add_bos)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = load_tokenizer(str(path))
    for text in TEXTS:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add), (text, add)
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert (ours.encode("x")[0] == 0) is add_bos


def test_add_eos_token_equals_transformers(tmp_path, vocab):
    from transformers import AutoTokenizer

    path = tmp_path / "eos.gguf"
    write_tokenizer_gguf(path, *vocab, pre="default", add_bos=True, add_eos=True)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = load_tokenizer(str(path))
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text), text
    assert ours.encode("x")[-1] == 1


def test_user_defined_tokens_stay_whole_and_are_not_special(tmp_path, vocab):
    path = tmp_path / "ud.gguf"
    write_tokenizer_gguf(path, *vocab, pre="default", add_bos=False)
    ours = load_tokenizer(str(path))
    think = vocab[0].index("<think>")
    assert ours.encode("<think>hi", add_special_tokens=False)[0] == think
    assert think not in ours.all_special_ids and ours.decode([think]) == "<think>"


def test_a_token_spelled_outside_the_byte_alphabet_is_respelled(tmp_path, vocab):
    from transformers import AutoTokenizer

    path = tmp_path / "respell.gguf"
    write_tokenizer_gguf(path, *vocab, pre="default", add_bos=False, extra=("two words",))
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = load_tokenizer(str(path))
    assert ours.vocab_size == len(hf) == len(vocab[0]) + 1
    assert ours.decode([len(vocab[0])]) == hf.decode([len(vocab[0])]) == "two words"
