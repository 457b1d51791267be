"""Prompts with CacheBlend segments: text -> token ids and segment spans.

A segment's KV is reused wherever it sits only if its tokens do not depend
on what surrounds it, so the prompt is tokenized piece by piece: the text
before the first segment (with the tokenizer's special tokens), each
segment on its own, each text between two segments, the text after the
last. The spans returned are the segments' ``[start, end)`` in those ids.

Segments are given either as the segment texts, which must appear in the
prompt in order (``segments_in``), or as a separator string that splits the
prompt (``split_on``): ``head SEP passage SEP passage SEP question`` makes
every piece between the first and the last separator a segment; the
separators stay in the prompt, as text between segments.

Errors are ``SegmentError`` naming the field (``blend.segments[i]``,
``blend.separator``), for a 400 that says what is wrong.
"""

from __future__ import annotations

from kvstrata.text.tokenizer import Tokenizer


class SegmentError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def segments_in(tokenizer: Tokenizer, text: str, segments: list[str], *,
                add_special: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and spans of ``segments``, found in ``text`` in order."""
    if not segments:
        raise SegmentError("blend.segments", "must hold at least one segment")
    pieces: list[tuple[str, bool]] = []  # (text, is a segment)
    pos = 0
    for i, seg in enumerate(segments):
        if not isinstance(seg, str) or not seg:
            raise SegmentError(f"blend.segments[{i}]", "must be a non-empty string")
        at = text.find(seg, pos)
        if at < 0:
            where = "in the prompt" if i == 0 else f"in the prompt after blend.segments[{i - 1}]"
            raise SegmentError(f"blend.segments[{i}]", f"does not occur {where} (segments must appear "
                                                      "verbatim, in order, without overlapping)")
        pieces += [(text[pos:at], False), (seg, True)]
        pos = at + len(seg)
    pieces.append((text[pos:], False))
    return _encode(tokenizer, pieces, add_special)


def split_on(tokenizer: Tokenizer, text: str, separator: str, *,
             add_special: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and spans of the pieces of ``text`` between the first and the last ``separator``."""
    if not isinstance(separator, str) or not separator:
        raise SegmentError("blend.separator", "must be a non-empty string")
    parts = text.split(separator)
    if len(parts) < 3:
        raise SegmentError("blend.separator", f"must occur at least twice in the prompt (head, segments, "
                                              f"question), found {len(parts) - 1} time(s)")
    pieces: list[tuple[str, bool]] = [(parts[0], False)]
    for part in parts[1:-1]:
        pieces += [(separator, False), (part, True)]
    pieces += [(separator, False), (parts[-1], False)]
    if not any(seg for seg, is_seg in pieces if is_seg):
        raise SegmentError("blend.separator", "leaves no non-empty segment between separators")
    return _encode(tokenizer, pieces, add_special)


def _encode(tokenizer: Tokenizer, pieces: list[tuple[str, bool]],
            add_special: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """The pieces tokenized one by one (special tokens, if any, with the first)."""
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    first = add_special
    for piece, is_segment in pieces:
        if not piece and not first:
            continue  # nothing to tokenize (the special tokens, if wanted, come with the first piece)
        toks = tokenizer.encode(piece, add_special_tokens=first)
        first = False
        if is_segment and toks:
            spans.append((len(ids), len(ids) + len(toks)))
        ids += toks
    return ids, spans
