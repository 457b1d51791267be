"""Prompts cut into CacheBlend segments: each piece tokenized on its own,
spans pointing at the segments' tokens, errors naming the field."""

from __future__ import annotations

import pytest

from kvstrata.text.segments import SegmentError, segments_in, split_on
from kvstrata.text.tokenizer import ByteTokenizer


def test_segments_found_in_order_are_tokenized_on_their_own():
    tok = ByteTokenizer()
    ids, spans = segments_in(tok, "head AAA mid BBB tail", ["AAA", "BBB"])
    assert ids == tok.encode("head ") + tok.encode("AAA", False) + tok.encode(" mid ", False) \
        + tok.encode("BBB", False) + tok.encode(" tail", False)
    assert [tok.decode(ids[s:e]) for s, e in spans] == ["AAA", "BBB"]
    # The same segment tokenizes to the same ids wherever it sits.
    ids2, spans2 = segments_in(tok, "x BBB y AAA z", ["BBB", "AAA"])
    assert ids2[spans2[1][0]:spans2[1][1]] == ids[spans[0][0]:spans[0][1]]


def test_a_separator_makes_the_middle_pieces_segments():
    tok = ByteTokenizer()
    ids, spans = split_on(tok, "sys|p1|p2|q", "|")
    assert [tok.decode(ids[s:e]) for s, e in spans] == ["p1", "p2"]
    assert tok.decode(ids[1:]) == "sys|p1|p2|q"  # the separators stay in the prompt


@pytest.mark.parametrize("call, field", [
    (lambda t: segments_in(t, "abc", ["abc", "abc"]), "blend.segments[1]"),
    (lambda t: segments_in(t, "abc", ["zz"]), "blend.segments[0]"),
    (lambda t: segments_in(t, "abc", [""]), "blend.segments[0]"),
    (lambda t: segments_in(t, "abc", []), "blend.segments"),
    (lambda t: split_on(t, "a|b", "|"), "blend.separator"),
    (lambda t: split_on(t, "a||b", "|"), "blend.separator"),
    (lambda t: split_on(t, "a|b|c", ""), "blend.separator"),
])
def test_errors_name_the_field(call, field):
    with pytest.raises(SegmentError) as e:
        call(ByteTokenizer())
    assert e.value.field == field
