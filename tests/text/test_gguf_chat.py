"""A GGUF's chat template (``tokenizer.chat_template`` metadata) renders as
transformers renders it (``apply_chat_template(..., tokenize=False,
add_generation_prompt=True)``) for SmolLM2's GGUF; a broken template in a
GGUF names the file and the key."""

from __future__ import annotations

import pytest

from kvstrata.text.chat import ChatTemplateError, chat_prompt
from kvstrata.text.tokenizer import load_tokenizer

gguf = pytest.importorskip("gguf")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about ü and 日本."}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "1+1?"},
     {"role": "assistant", "content": "2"}, {"role": "user", "content": "and 2+2?\n\n  (show work)"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system+user", "multi-turn", "system+multi-turn"])
def test_rendering_equals_transformers(smollm2_gguf, hf_smollm2_tokenizer, messages):
    tok = load_tokenizer(str(smollm2_gguf))
    want = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.chat_template.render(messages, add_generation_prompt=True) == want
    want_ids = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                        return_dict=True)["input_ids"]
    assert chat_prompt(tok, messages) == list(want_ids)
    without = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert tok.chat_template.render(messages, add_generation_prompt=False) == without


def test_a_broken_gguf_template_names_the_file_and_key(tmp_path):
    path = tmp_path / "broken-template.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "</s>", "a", "aa"])
    w.add_token_types([3, 3, 1, 1])
    w.add_token_merges(["a a"])
    w.add_chat_template("{% for m in messages %}{{ m['content'] }")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ChatTemplateError, match=r"broken-template.gguf \(tokenizer.chat_template\)"):
        load_tokenizer(str(path))


def test_a_gguf_without_a_template_has_none(tmp_path):
    path = tmp_path / "plain.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "</s>", "a", "aa"])
    w.add_token_merges(["a a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = load_tokenizer(str(path))
    assert tok.chat_template is None
    assert chat_prompt(tok, [{"role": "user", "content": "x"}]) == "<|user|>\nx\n<|assistant|>\n"
