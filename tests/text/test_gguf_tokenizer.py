"""The tokenizer kvstrata builds from a GGUF's metadata (``tokenizer.ggml.*``)
against transformers' ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``:
the same ids on varied text (unicode, code, whitespace runs, special tokens),
the same special ids, and decoding gives the text back."""

from __future__ import annotations

import pytest

from kvstrata.text.tokenizer import load_tokenizer

TEXTS = [
    "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n ", "a", "Hello, world!", " Hello", "Hello  world   again    .",
    "The quick brown fox jumps over the lazy dog.", "I'm sure they'll've done it, won't they? It's", "HELLO'S",
    "12345678901234567890", "3.14159 + 2.71828 = 5.85987", "1,000,000 and 1.000.000", "x=1;y=2\r\nz=3",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    '{"key": [1, 2, {"nested": null}], "s": "\\u00e9"}', "<html><body><p class='x'>hi</p></body></html>",
    "SELECT * FROM users WHERE id = 42;", "$ ls -la | grep '.py' > out.txt 2>&1",
    "café naïve façade résumé", "Ünïcödé ÄÖÜ ß", "日本語のテキスト", "中文，标点。", "한국어 문장입니다",
    "Здравствуй, мир", "مرحبا بالعالم", "שלום עולם", "ελληνικά", "हिन्दी", "🙂🚀👩‍👩‍👧‍👦 emoji", "e\u0301 combining",
    "\u200b zero width \ufeff bom", "a\u00a0non-breaking space", "tab\tseparated\tvalues", "trailing spaces   ",
    "   leading spaces", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text", "<|im_end|><|im_end|>", "<|im_start", "< |im_start|>", "<repo_name>kvstrata<file_sep>",
    "<jupyter_code>print(1)<jupyter_output>1<empty_output>", "mixed 日本 and English and 123 and 🙂",
    "Ġ Ċ literal byte-alphabet characters", "a" * 200, "ab " * 50,
]


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return load_tokenizer(str(smollm2_gguf))


def test_there_are_about_fifty_texts():
    assert len(TEXTS) >= 50 and len(set(TEXTS)) == len(TEXTS)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_ids_equal_transformers(ours, hf_smollm2_tokenizer, add_special_tokens):
    for text in TEXTS:
        want = hf_smollm2_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == want, repr(text)


def test_special_ids_equal_transformers(ours, hf_smollm2_tokenizer):
    hf = hf_smollm2_tokenizer
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    assert ours.all_special_ids == {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert len(ours.all_special_ids) == 17  # the control tokens, <|endoftext|> .. <empty_output>
    assert ours.vocab_size == len(hf) == 49152


def test_decoding_gives_the_text_back(ours, hf_smollm2_tokenizer):
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=False) == text, repr(text)
        want = hf_smollm2_tokenizer.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=True) == want, repr(text)


def test_streamed_decoding_equals_decode(ours):
    prompt = ours.encode("Say something:", add_special_tokens=False)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        stream = ours.decode_stream(prompt)
        assert "".join(stream.step(t) for t in ids) == ours.decode(ids), repr(text)
