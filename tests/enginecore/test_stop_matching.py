"""Stop strings are matched incrementally: the result equals a naive search
of the whole text after every step (earliest start wins, ties in list order,
min_tokens floor, hold-back of possible stop prefixes), and a step reads
only its new characters, however long the text and the stop strings."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.text.detokenizer import IncrementalDetokenizer
from kvstrata.text.tokenizer import ByteTokenizer

BYTES = ByteTokenizer()
PROMPT = [256, 104, 105]


def first_match(text: str, stops: list[str], floor: int):
    """Earliest-starting match (ties: list order) whose last char is at index >= floor."""
    found = []
    for j, s in enumerate(stops):
        idx = text.find(s)
        while idx >= 0 and idx + len(s) - 1 < floor:
            idx = text.find(s, idx + 1)
        if idx >= 0:
            found.append((idx, j, s))
    return min(found) if found else None


def naive(steps: list[str], stops: list[str], include: bool, floor: int = 0):
    """Search the whole text after every step; hold back the longest suffix
    that is a proper prefix of a stop string."""
    text, emitted = "", []
    for piece in steps:
        text += piece
        m = first_match(text, stops, floor)
        if m is not None:
            idx, _, s = m
            emitted.append(text[: idx + len(s) if include else idx])
            return emitted, s
        held = 0
        if not include:
            for s in stops:
                for k in range(len(s) - 1, 0, -1):
                    if text.endswith(s[:k]):
                        held = max(held, k)
                        break
        emitted.append(text[: len(text) - held])
    return emitted, None


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.sampled_from(b"ab c"), min_size=1, max_size=40),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=5), min_size=1, max_size=4),
    include=st.booleans(),
)
def test_incremental_matching_equals_a_whole_text_search(tokens, stops, include):
    # one byte token per step, no min_tokens: every step's text is one char
    detok = IncrementalDetokenizer(BYTES, PROMPT, stops, include)
    emitted, stop = "", None
    steps = [chr(t) for t in tokens]
    want_emitted, want_stop = naive(steps, stops, include)
    got_emitted = []
    for t in tokens:
        delta, stop = detok.update([t])
        emitted += delta
        got_emitted.append(emitted)
        if stop is not None:
            break
    assert stop == want_stop
    assert got_emitted == want_emitted


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.sampled_from(b"ab"), min_size=1, max_size=30),
    stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=4), min_size=1, max_size=3),
    min_tokens=st.integers(0, 10),
    chunk=st.integers(1, 4),
)
def test_min_tokens_floor_and_multi_token_steps(tokens, stops, min_tokens, chunk):
    """Several tokens per step; a match must end after the first min_tokens
    output tokens' text (as in vLLM)."""
    detok = IncrementalDetokenizer(BYTES, PROMPT, stops, False, min_tokens=min_tokens)
    stop, out = None, ""
    for i in range(0, len(tokens), chunk):
        delta, stop = detok.update(tokens[i:i + chunk])
        out += delta
        if stop is not None:
            break
    steps = [bytes(tokens[i:i + chunk]).decode() for i in range(0, len(tokens), chunk)]
    floor = max(min_tokens - 1, 0)  # one char per token: the min_tokens-th token's index
    want_emitted, want_stop = naive(steps, stops, False, floor)
    assert stop == want_stop
    assert out == want_emitted[-1]


def test_a_step_reads_only_its_new_characters():
    """64 stop strings of 1,024 chars that the text keeps almost matching
    (the worst case for rescanning): the matcher reads each new character
    once per stop string, never the earlier text."""
    stops = ["a" * 1023 + chr(ord("b") + i % 20) for i in range(64)]
    detok = IncrementalDetokenizer(BYTES, PROMPT, stops, False)
    n = 3000
    for _ in range(n):
        delta, stop = detok.update([ord("a")])
        assert stop is None
    assert detok._matcher.scanned == 64 * n
    # everything that could still start a stop string is held back, the rest is out
    assert len(detok.output_text) == n and detok._emitted == n - 1023
    delta, stop = detok.update([ord("b")])
    assert stop == stops[0] and detok.output_text == "a" * (n - 1023)
