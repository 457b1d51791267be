"""The one text path (``kvstrata.text.prompts``): cheap bounds before any
tokenizing (characters, messages, segments), long texts tokenized in a
low-priority worker thread with the same ids as on the loop, and the
tokenizer facts the bounds stand on (``max_token_chars``, sound for every
text) and the checkpoint's sampling defaults."""

from __future__ import annotations

import json
import os
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kvstrata.errors import RequestError
from kvstrata.text.chat import plain_chat
from kvstrata.text.prompts import WORKER_NICE, ChatPrompt, PromptTokenizer, SegmentedPrompt, TextPrompt
from kvstrata.text.segments import segments_in, split_on
from kvstrata.text.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, sampling_defaults_in, \
    GENERATION_CONFIG_KEYS, token_char_bound

CORPUS = ["the river runs north past the old mill", "bread is baked at dawn ==== #### ----",
          "merchants trade salt, wool and copper; the capital keeps records"] * 20


def _bpe(pre=None, normalizer=None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre or pre_tokenizers.ByteLevel(add_prefix_space=False)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, show_progress=False, special_tokens=["<s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.fixture(scope="module")
def bpe() -> HFTokenizer:
    return HFTokenizer(tokenizer=_bpe(), eos_token_id=0)


class CountingTokenizer(ByteTokenizer):
    """Byte-level, recording every call that tokenizes and the thread (name, nice) it ran on."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def _note(self) -> None:
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if sys.platform == "linux" else 0
        self.calls.append((threading.current_thread().name, nice))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._note()
        return super().encode(text, add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        self._note()
        return [ByteTokenizer.encode(self, t, add_special_tokens) for t in texts]


async def _refused(pt: PromptTokenizer, prompt) -> RequestError:
    with pytest.raises(RequestError) as info:
        await pt.ids(prompt)
    return info.value


async def test_a_text_past_the_character_bound_is_refused_before_tokenizing():
    tok = CountingTokenizer()
    pt = PromptTokenizer(tok, max_model_len=100)
    assert pt.max_prompt_chars == 100  # a byte-level token stands for one character at most
    for prompt in ("x" * 101, TextPrompt("x" * 10**6), SegmentedPrompt(prompt="x" * 101 + "|a|b", separator="|")):
        err = await _refused(pt, prompt)
        assert err.field == "prompt" and "max_model_len=100" in str(err)
    err = await _refused(pt, ChatPrompt(messages=[{"role": "user", "content": "x" * 200}]))
    assert err.field == "messages"
    assert tok.calls == []
    assert len((await pt.ids("x" * 99)).ids) == 100  # BOS + 99 bytes: fits
    assert (await _refused(pt, "x" * 100)).field == "prompt"  # BOS + 100: one token too many


async def test_counts_past_their_bounds_are_refused_before_tokenizing():
    tok = CountingTokenizer()
    pt = PromptTokenizer(tok, max_model_len=100)
    err = await _refused(pt, SegmentedPrompt(prompt="a" * 80, segments=["a"] * 65))
    assert err.field == "blend.segments" and "64" in str(err)
    err = await _refused(PromptTokenizer(tok, 1000), SegmentedPrompt(prompt="h|" + "p|" * 65 + "q", separator="|"))
    assert err.field == "blend.separator" and "64" in str(err)
    err = await _refused(pt, ChatPrompt(messages=[{"role": "user", "content": ""}] * 101))
    assert err.field == "messages" and "101 messages" in str(err)
    parts = [{"type": "text", "text": ""}] * 100
    assert (await _refused(pt, ChatPrompt(messages=[{"role": "user", "content": parts}]))).field == "messages"
    assert tok.calls == []


async def test_long_texts_are_tokenized_in_a_low_priority_worker_with_the_same_ids():
    tok = CountingTokenizer()
    inline = PromptTokenizer(tok, max_model_len=10**6)
    worker = PromptTokenizer(tok, max_model_len=10**6, inline_chars=0)
    prompts = ["héllo wörld", ChatPrompt(messages=[{"role": "user", "content": "hi"}]),
               SegmentedPrompt(prompt="head A mid B tail", segments=["A", "B"], recompute_ratio=0.5)]
    on_loop = [await inline.ids(p) for p in prompts]
    main = threading.current_thread().name
    assert {name for name, _ in tok.calls} == {main}
    tok.calls.clear()
    assert [await worker.ids(p) for p in prompts] == on_loop
    assert len(tok.calls) >= 3 and all(name.startswith("kvstrata-tokenize") for name, _ in tok.calls)
    if sys.platform == "linux":
        assert all(nice == WORKER_NICE for _, nice in tok.calls)


async def test_segments_and_chat_give_the_ids_of_their_sync_forms(bpe):
    pt = PromptTokenizer(bpe, max_model_len=4096, inline_chars=16)  # long enough for the worker
    text = "head the river runs mid bread is baked tail"
    ids, spans = await pt.ids(SegmentedPrompt(prompt=text, segments=["the river runs", "bread is baked"]))
    assert (ids, spans) == segments_in(bpe, text, ["the river runs", "bread is baked"])
    ids, spans = await pt.ids(SegmentedPrompt(prompt="a|b c|d e|f", separator="|"))
    assert (ids, spans) == split_on(bpe, "a|b c|d e|f", "|")
    messages = [{"role": "user", "content": "where is the mill?"}]
    assert (await pt.ids(ChatPrompt(messages=messages))).ids == bpe.encode(plain_chat(messages))
    assert (await _refused(pt, ChatPrompt(messages=[{"role": "robot", "content": "x"}]))).field == "messages[0].role"


async def test_decode_is_bounded_and_checks_the_vocabulary(bpe):
    pt = PromptTokenizer(bpe, max_model_len=50)
    ids = bpe.encode("the river runs north", add_special_tokens=False)
    assert await pt.decode(ids) == "the river runs north"
    assert await PromptTokenizer(bpe, max_model_len=50, inline_chars=0).decode(ids) == "the river runs north"
    for bad in ([1] * 51, [1, bpe.vocab_size], [-1], [1.5]):
        with pytest.raises(RequestError) as info:
            await pt.decode(bad)
        assert info.value.field == "tokens"


def test_batch_calls_give_the_ids_and_text_of_the_single_ones(bpe):
    texts = ["the river <s> runs", "", "ünïcödé and ==== ####", " leading space"]
    assert bpe.encode_batch(texts, True) == [bpe.encode(t, True) for t in texts]
    assert bpe.encode_batch(texts, False) == [bpe.encode(t, False) for t in texts]
    seqs = [bpe.encode(t, False) for t in texts]
    assert bpe.decode_batch(seqs, False) == [bpe.decode(s, False) for s in seqs]


@settings(max_examples=200, deadline=None)
@given(text=st.text(min_size=1, max_size=200))
def test_no_token_stands_for_more_than_max_token_chars(bpe, text):
    bound = bpe.max_token_chars
    assert bound is not None and len(text) <= len(bpe.encode(text, add_special_tokens=False)) * bound


def test_max_token_chars_is_none_where_no_bound_is_sound():
    byte_level = _bpe()
    assert token_char_bound(byte_level) == max(map(len, byte_level.get_vocab(with_added_tokens=True)))
    assert token_char_bound(_bpe(normalizer=normalizers.NFC())) == 4 * token_char_bound(byte_level)
    sentencepiece_like = _bpe(normalizer=normalizers.Sequence([normalizers.Prepend("▁"),
                                                               normalizers.Replace(" ", "▁")]))
    assert token_char_bound(sentencepiece_like) == max(map(len, sentencepiece_like.get_vocab()))
    assert token_char_bound(_bpe(pre=pre_tokenizers.Whitespace())) is None  # drops the spaces
    assert token_char_bound(_bpe(normalizer=normalizers.Strip())) is None
    assert token_char_bound(_bpe(normalizer=normalizers.Replace("  ", " "))) is None
    assert token_char_bound(Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))) is None
    fused = Tokenizer(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True))
    assert token_char_bound(fused) is None
    assert ByteTokenizer().max_token_chars == 1


def test_sampling_defaults_keep_what_a_request_could_carry():
    cfg = {"temperature": 0.6, "top_p": 0.95, "top_k": 20.0, "min_p": 0, "max_new_tokens": 64,
           "do_sample": True, "repetition_penalty": 1.1}
    assert dict(sampling_defaults_in(cfg, GENERATION_CONFIG_KEYS, "x")) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0, "max_tokens": 64}
    bad = {"temperature": "hot", "top_p": 0.0, "top_k": 1.5, "min_p": True, "max_new_tokens": 0}
    assert dict(sampling_defaults_in(bad, GENERATION_CONFIG_KEYS, "x")) == {}


def test_a_checkpoints_generation_config_is_read_with_its_tokenizer(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "top_p": 0.9}))
    assert dict(load_tokenizer(str(tmp_path)).generation_defaults) == {"temperature": 0.2, "top_p": 0.9}
    _bpe().save(str(tmp_path / "tokenizer.json"))
    assert dict(load_tokenizer(str(tmp_path)).generation_defaults) == {"temperature": 0.2, "top_p": 0.9}
