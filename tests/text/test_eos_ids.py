"""Every id that ends a reply, as the tokenizer reports it
(``eos_token_ids``): the tokenizer's EOS token, config.json's and
generation_config.json's ``eos_token_id`` (an int or a list in either), and
for a GGUF its EOS, end-of-turn and end-of-message ids."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvstrata.text.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "enginecore"))
from hf_utils import write_bytelevel_bpe_tokenizer  # noqa: E402

gguf = pytest.importorskip("gguf")


@pytest.fixture
def tok_dir(tmp_path):
    write_bytelevel_bpe_tokenizer(tmp_path)  # <s>=0, </s>=1, tokenizer_config names </s> as EOS
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    return tmp_path


def test_generation_config_list_adds_its_ids(tok_dir):
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = load_tokenizer(str(tok_dir))
    assert tok.eos_token_id == 1
    assert tok.eos_token_ids == (1, 2, 7)


def test_a_config_json_list_and_a_generation_config_int(tok_dir):
    (tok_dir / "config.json").write_text(json.dumps({"eos_token_id": [1, 9]}))
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert load_tokenizer(str(tok_dir)).eos_token_ids == (1, 9, 4)


def test_without_configs_the_tokenizer_eos_alone(tok_dir):
    (tok_dir / "config.json").unlink()
    assert load_tokenizer(str(tok_dir)).eos_token_ids == (1,)


def test_a_malformed_eos_list_names_the_file(tok_dir):
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, "</s>"]}))
    with pytest.raises(ValueError, match="generation_config.json.*eos_token_id"):
        load_tokenizer(str(tok_dir))


def test_gguf_eos_eot_and_eom(tmp_path):
    path = tmp_path / "t.gguf"
    tokens = ["<s>", "</s>", "<|eot_id|>", "<|eom_id|>", "a", "b", "ab"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3, 3, 1, 1, 1])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_eot_token_id(2)
    w.add_eom_token_id(3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = load_tokenizer(str(path))
    assert (tok.eos_token_id, tok.eos_token_ids) == (1, (1, 2, 3))
    assert tok.encode("ab<|eot_id|>", add_special_tokens=False) == [6, 2]
