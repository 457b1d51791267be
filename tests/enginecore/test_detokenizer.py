"""Incremental detokenization: split UTF-8, stop strings spanning tokens,
hold-back of possible stop prefixes, min_tokens, flush at finish."""

from __future__ import annotations

import pytest
from hf_utils import write_bytelevel_bpe_tokenizer, write_sentencepiece_byte_fallback_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.text.detokenizer import IncrementalDetokenizer
from kvstrata.text.tokenizer import ByteTokenizer, load_tokenizer

BYTES = ByteTokenizer()
PROMPT = [256, 104, 105]


def feed(detok, chunks, finish=True):
    deltas, stop = [], None
    for i, chunk in enumerate(chunks):
        delta, stop = detok.update(chunk, finished=finish and i == len(chunks) - 1)
        deltas.append(delta)
        if stop is not None:
            break
    return deltas, stop


def byte_chunks(text: str, sizes=None):
    data = list(text.encode())
    if sizes is None:
        return [[b] for b in data]
    out, i = [], 0
    for n in sizes:
        out.append(data[i : i + n])
        i += n
    return out + ([data[i:]] if i < len(data) else [])


def test_multibyte_characters_appear_when_complete():
    detok = IncrementalDetokenizer(BYTES, PROMPT, [], False)
    deltas, stop = feed(detok, byte_chunks("a日😀"))
    assert deltas == ["a", "", "", "日", "", "", "", "😀"] and stop is None


def test_stop_string_spanning_tokens_is_excluded():
    detok = IncrementalDetokenizer(BYTES, PROMPT, ["END"], False)
    deltas, stop = feed(detok, byte_chunks("abcEND!", [2, 2, 1, 2]))  # "ab" "cE" "N" "D!"
    assert deltas == ["ab", "c", "", ""] and stop == "END"
    assert detok.output_text == "abc"
    assert detok.update([65]) == ("", None)  # done


def test_stop_string_included_when_asked():
    detok = IncrementalDetokenizer(BYTES, PROMPT, ["END"], True)
    deltas, stop = feed(detok, byte_chunks("abcEND!", [2, 2, 1, 2]))
    assert deltas == ["ab", "cE", "N", "D"] and stop == "END"


def test_held_back_prefix_is_released_when_it_diverges():
    detok = IncrementalDetokenizer(BYTES, PROMPT, ["ENDX"], False)
    deltas, stop = feed(detok, byte_chunks("xENDy"), finish=False)
    assert deltas == ["x", "", "", "", "ENDy"] and stop is None


def test_finish_flushes_held_back_text():
    detok = IncrementalDetokenizer(BYTES, PROMPT, ["END"], False)
    assert detok.update(list(b"abEN")) == ("ab", None)
    assert detok.update([], finished=True) == ("EN", None)


def test_stop_string_with_multibyte_characters():
    detok = IncrementalDetokenizer(BYTES, PROMPT, ["本語"], False)
    deltas, stop = feed(detok, byte_chunks("日本語です"))
    assert "".join(deltas) == "日" and stop == "本語"


def test_earliest_stop_string_wins():
    detok = IncrementalDetokenizer(BYTES, PROMPT, ["cd", "abc"], False)
    deltas, stop = feed(detok, [list(b"xabcdz")])
    assert deltas == ["x"] and stop == "abc"


def test_stop_strings_ignored_within_min_tokens():
    detok = IncrementalDetokenizer(BYTES, PROMPT, ["ab"], False, min_tokens=3)
    deltas, stop = feed(detok, byte_chunks("abxab!"), finish=False)
    assert "".join(deltas) == "abx" and stop == "ab"
    straddle = IncrementalDetokenizer(BYTES, PROMPT, ["ab"], False, min_tokens=1)
    assert straddle.update(list(b"ab")) == ("", "ab")  # ends after the first token: counts


def test_stop_token_text_is_left_out_unless_included():
    detok = IncrementalDetokenizer(BYTES, PROMPT, [], False)
    assert detok.update([104, 33], stop_terminated=True) == ("h", None)
    kept = IncrementalDetokenizer(BYTES, PROMPT, [], True)
    assert kept.update([104, 33], stop_terminated=True) == ("h!", None)


@given(
    text=st.text(alphabet="abEND日😀 ", max_size=30),
    stop=st.text(alphabet="abEND日", min_size=1, max_size=4),
    include=st.booleans(),
    sizes=st.lists(st.integers(1, 5), max_size=40),
)
@settings(max_examples=300, deadline=None)
def test_streamed_text_equals_truncated_text(text, stop, include, sizes):
    detok = IncrementalDetokenizer(BYTES, PROMPT, [stop], include)
    deltas, got_stop = feed(detok, byte_chunks(text, sizes) or [[]])
    idx = text.find(stop)
    if idx < 0:
        assert "".join(deltas) == text and got_stop is None
    else:
        assert "".join(deltas) == text[: idx + (len(stop) if include else 0)] and got_stop == stop


@pytest.mark.parametrize("writer", [write_bytelevel_bpe_tokenizer, write_sentencepiece_byte_fallback_tokenizer])
def test_hf_tokenizer_stream_and_stop(tmp_path, writer):
    writer(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    prompt = tok.encode("hello")
    text = " the 日本語 wörld 😀! STOP here"
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(prompt + ids)[len("hello"):]
    assert full.endswith(text)  # a SentencePiece normaliser may add a leading space
    detok = IncrementalDetokenizer(tok, prompt, [], False)
    assert "".join(feed(detok, [[i] for i in ids])[0]) == full
    detok = IncrementalDetokenizer(tok, prompt, ["ST", "😀!"], False)
    deltas, stop = feed(detok, [[i] for i in ids])
    assert "".join(deltas) == full[: full.index("😀!")] and stop == "😀!"
