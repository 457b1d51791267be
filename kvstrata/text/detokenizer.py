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
"""

from __future__ import annotations

from kvstrata.text.tokenizer import Tokenizer


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
        if self._stop and self._search_floor >= 0:
            match = self._find_stop(text, max(prev_len, self._search_floor))
            if match is not None:
                start, stop_str = match
                end = start + len(stop_str) if self._include_stop else start
                self._text = text[:end]
                return self._emit(end, done=True), stop_str
        if finished or stop_terminated:
            return self._emit(len(text), done=True), None
        held = 0 if self._include_stop or not self._stop else self._stop_prefix_len(text)
        return self._emit(len(text) - held, done=False), None

    def _decode(self, ids: list[int]) -> None:
        step = self._stream.step
        pieces = []
        for token_id in ids:
            pieces.append(step(token_id))
            self._num_tokens += 1
            if self._num_tokens == self._min_tokens:
                # Text up to here may not end a stop string (min_tokens).
                self._search_floor = len(self._text) + sum(map(len, pieces))
        self._text += "".join(pieces)

    def _find_stop(self, text: str, new_from: int) -> tuple[int, str] | None:
        """The earliest stop string that ends after ``new_from`` (ties: list order)."""
        best: tuple[int, str] | None = None
        for stop_str in self._stop:
            idx = text.find(stop_str, max(0, new_from - len(stop_str) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop_str)
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of the unreturned text that is a proper
        prefix of some stop string (the part that must be held back)."""
        room = len(text) - self._emitted
        held = 0
        for stop_str in self._stop:
            for k in range(min(len(stop_str) - 1, room), held, -1):
                if text.endswith(stop_str[:k]):
                    held = k
                    break
        return held

    def _emit(self, upto: int, done: bool) -> str:
        delta = self._text[self._emitted : upto]
        self._emitted = upto
        self._done = done
        return delta
