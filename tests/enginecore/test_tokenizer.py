"""Tokenizers: byte-level fallback and tokenizer.json through `tokenizers`."""

from __future__ import annotations

import json

import pytest
from hf_utils import write_bytelevel_bpe_tokenizer, write_sentencepiece_byte_fallback_tokenizer

from kvstrata.text.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXT = "hello the 日本語 wörld 😀!"


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids[0] == 256 and ids[1:] == list(TEXT.encode())
    assert tok.encode("ab", add_special_tokens=False) == [97, 98]
    assert tok.decode([*ids, 257]) == TEXT
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (258, 256, 257)
    assert tok.all_special_ids == {256, 257}


def test_byte_tokenizer_decodes_invalid_utf8_with_replacement():
    assert ByteTokenizer().decode([0xE6, 0x97, 0x41, 300]) == "\ufffdA"


def test_byte_stream_holds_partial_characters():
    stream = ByteTokenizer().decode_stream([256])
    out = [stream.step(b) for b in "日😀".encode()]
    assert out == ["", "", "日", "", "", "", "😀"]


def test_byte_stream_continues_a_character_begun_in_the_prompt():
    data = "x日".encode()
    stream = ByteTokenizer().decode_stream([256, *data[:2]])  # prompt ends inside 日
    assert [stream.step(b) for b in data[2:]] == ["", "日"]


def test_load_tokenizer_falls_back_to_bytes(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)
    with pytest.raises(ValueError, match="is not a directory"):
        load_tokenizer(str(tmp_path / "missing"))


@pytest.mark.parametrize("writer", [write_bytelevel_bpe_tokenizer, write_sentencepiece_byte_fallback_tokenizer])
def test_tokenizer_json_round_trip(tmp_path, writer):
    writer(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == TEXT  # BOS skipped
    assert tok.decode([*ids, tok.eos_token_id, 10**6]) == TEXT  # EOS skipped, out-of-vocab dropped
    assert {tok.bos_token_id, tok.eos_token_id} <= tok.all_special_ids


@pytest.mark.parametrize("writer", [write_bytelevel_bpe_tokenizer, write_sentencepiece_byte_fallback_tokenizer])
def test_tokenizer_stream_equals_decode(tmp_path, writer):
    writer(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    prompt = tok.encode("hello")
    out = tok.encode(TEXT, add_special_tokens=False)
    stream = tok.decode_stream(prompt)
    streamed = "".join(stream.step(t) for t in out)
    assert prompt + out and tok.decode(prompt) + streamed == tok.decode(prompt + out)


def test_special_ids_fall_back_to_config_json(tmp_path):
    write_bytelevel_bpe_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [1, 0], "bos_token_id": 0}))
    tok = load_tokenizer(str(tmp_path))
    assert (tok.eos_token_id, tok.bos_token_id) == (1, 0)
