"""Incremental detokenization with stop strings.

Text is produced by the tokenizer's decode stream, which releases only whole
characters: a UTF-8 character split across byte tokens comes out once its
last byte arrives. Stop strings are searched in the text as it grows; a match
may span any number of tokens. Until a request finishes, text that could
still turn out to be the start of a stop string is held back, so a caller
never receives characters that a later match removes:

    stop = ["END"], tokens decode to  "ab" "cE" "N"  "D!"
    deltas returned                   "ab" "c"  ""   ""   -> stop "END"
    (the "E", then "EN", are held back; "D!" completes the match, the text
     ends before it, and "!" is dropped)

Matching is incremental: each stop string has a KMP automaton whose state is
the longest prefix of it that the text ends with, so a step reads only its
new characters (once per stop string), never the text before them, and the
held-back length is the largest state. A step costs O(stops x new chars)
whatever the lengths of the text and of the stop strings (which
``SamplingParams.validate`` bounds).
"""

from __future__ import annotations

from kvstrata.text.tokenizer import Tokenizer


class StopMatcher:
    """Owns: one KMP automaton per stop string (its failure table and state).

    ``feed(text, start, floor)`` advances every automaton over
    ``text[start:]`` and returns the earliest-starting match (ties: list
    order) that ends after index ``floor`` (-1: none may match yet), or None;
    ``held()`` is the longest proper stop prefix the text now ends with.
    ``scanned`` counts characters read (for tests of the per-step cost).
    """

    __slots__ = ("stops", "_fail", "_state", "scanned")

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._fail = [_failure(s) for s in stops]
        self._state = [0] * len(stops)
        self.scanned = 0

    def feed(self, text: str, start: int, floor: int | None) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        n = len(text)
        for i, stop in enumerate(self.stops):
            fail, k, m = self._fail[i], self._state[i], len(stop)
            found = -1
            for pos in range(start, n):
                c = text[pos]
                while k and stop[k] != c:
                    k = fail[k - 1]
                if stop[k] == c:
                    k += 1
                    if k == m:
                        if floor is not None and pos >= floor and found < 0:
                            found = pos + 1 - m
                        k = fail[k - 1]
            self._state[i] = k
            self.scanned += n - start
            if found >= 0 and (best is None or found < best[0]):
                best = (found, stop)
        return best

    def held(self) -> int:
        return max(self._state, default=0)


def _failure(p: str) -> list[int]:
    """KMP: fail[i] = length of the longest proper prefix of p[:i+1] that is
    also its suffix."""
    fail = [0] * len(p)
    k = 0
    for i in range(1, len(p)):
        while k and p[i] != p[k]:
            k = fail[k - 1]
        if p[i] == p[k]:
            k += 1
        fail[i] = k
    return fail


class IncrementalDetokenizer:
    """Owns: one request's output text, how much of it was returned, and its
    decode stream.

    ``update(ids, finished=..., stop_terminated=...)``: ``finished`` says the
    request ends with these tokens (EOS, a stop token, max_tokens), so nothing
    is held back; ``stop_terminated`` says the last id is a stop token, whose
    text is left out unless ``include_stop_str_in_output``. Stop strings are
    looked for only in text that ends after the first ``min_tokens`` output
    tokens, as in vLLM.

    Without stop strings nothing is ever held back: each delta is final and
    is kept as a piece (``output_text`` joins them on demand), so a long
    output costs no repeated copying of its text.
    """

    __slots__ = (
        "_stream",
        "_stop",
        "_include_stop",
        "_min_tokens",
        "_num_tokens",
        "_search_floor",
        "_emitted",
        "_done",
        "_text",
        "_pieces",
        "_matcher",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool,
        *,
        min_tokens: int = 0,
    ) -> None:
        self._stream = tokenizer.decode_stream(prompt_token_ids)
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._search_floor = 0 if min_tokens == 0 else -1  # -1: not reached yet
        self._emitted = 0
        self._done = False
        self._text = ""  # with stop strings: the whole text, searched as it grows
        self._pieces: list[str] = []  # without: the deltas
        self._matcher = StopMatcher(self._stop) if self._stop else None

    @property
    def output_text(self) -> str:
        """The request's text so far (after a stop string: up to it)."""
        return self._text if self._stop else "".join(self._pieces)

    def update(
        self, new_token_ids: list[int], *, finished: bool = False, stop_terminated: bool = False
    ) -> tuple[str, str | None]:
        """Decode ``new_token_ids``; returns (text delta, the stop string matched or None).

        After a match (or ``finished``) the detokenizer is done and further
        calls return ("", None).
        """
        if self._done:
            return "", None
        ids = new_token_ids
        if stop_terminated and not self._include_stop and ids:
            ids = ids[:-1]
        if not self._stop:  # the common case: decode and hand over
            step = self._stream.step
            delta = step(ids[0]) if len(ids) == 1 else "".join(map(step, ids))
            self._pieces.append(delta)
            self._done = finished or stop_terminated
            return delta, None
        prev_len = len(self._text)
        self._decode(ids)
        text = self._text
        matcher = self._matcher
        assert matcher is not None
        # a match must end past the min_tokens floor (index of its last char >= floor)
        floor = self._search_floor if self._search_floor >= 0 else None
        match = matcher.feed(text, prev_len, floor)
        if match is not None:
            start, stop_str = match
            end = start + len(stop_str) if self._include_stop else start
            self._text = text[:end]
            return self._emit(end, done=True), stop_str
        if finished or stop_terminated:
            return self._emit(len(text), done=True), None
        held = 0 if self._include_stop else min(matcher.held(), len(text) - self._emitted)
        return self._emit(len(text) - held, done=False), None

    def _decode(self, ids: list[int]) -> None:
        step = self._stream.step
        pieces = []
        for token_id in ids:
            pieces.append(step(token_id))
            self._num_tokens += 1
            if self._num_tokens == self._min_tokens:
                # A stop string may end in this token's text or later, not
                # before (vLLM checks stops once min_tokens are out).
                self._search_floor = len(self._text) + sum(map(len, pieces[:-1]))
        self._text += "".join(pieces)

    def _emit(self, upto: int, done: bool) -> str:
        delta = self._text[self._emitted : upto]
        self._emitted = upto
        self._done = done
        return delta
