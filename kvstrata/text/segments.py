"""Prompts with CacheBlend segments: text -> pieces -> token ids and segment spans.

A segment's KV is reused wherever it sits only if its tokens do not depend
on what surrounds it, so the prompt is tokenized piece by piece: the text
before the first segment (with the tokenizer's special tokens), each
segment on its own, each text between two segments, the text after the
last. The spans returned are the segments' ``[start, end)`` in those ids.

Segments are given either as the segment texts, which must appear in the
prompt in order (``segment_pieces``), or as a separator string that splits
the prompt (``separator_pieces``): ``head SEP passage SEP passage SEP
question`` makes every piece between the first and the last separator a
segment; the separators stay in the prompt, as text between segments.
Cutting is pure string work (``str.find``, ``str.split``) and refuses more
than ``max_segments`` segments before any piece is tokenized; ``join_pieces``
puts the pieces' ids together. ``segments_in`` and ``split_on`` do the
three steps on the caller's thread (the server's path,
``kvstrata.text.prompts``, tokenizes long prompts in a worker thread).

Errors are ``SegmentError`` naming the field (``blend.segments[i]``,
``blend.separator``), for a 400 that says what is wrong.
"""

from __future__ import annotations

import itertools

from kvstrata.text.tokenizer import Tokenizer
from kvstrata.types import MAX_BLEND_SEGMENTS

Pieces = list[tuple[str, bool]]  # (text, is a segment), in prompt order


class SegmentError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def segment_pieces(text: str, segments: list[str], *, max_segments: int = MAX_BLEND_SEGMENTS) -> Pieces:
    """``text`` cut around ``segments``, found in it in order."""
    if not segments:
        raise SegmentError("blend.segments", "must hold at least one segment")
    if len(segments) > max_segments:
        raise SegmentError("blend.segments", f"must hold at most {max_segments} segments, got {len(segments)}")
    pieces: Pieces = []
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
    return pieces


def separator_pieces(text: str, separator: str, *, max_segments: int = MAX_BLEND_SEGMENTS) -> Pieces:
    """``text`` cut at ``separator``: the pieces between its first and last occurrence are segments."""
    if not isinstance(separator, str) or not separator:
        raise SegmentError("blend.separator", "must be a non-empty string")
    parts = text.split(separator)
    if len(parts) < 3:
        raise SegmentError("blend.separator", f"must occur at least twice in the prompt (head, segments, "
                                              f"question), found {len(parts) - 1} time(s)")
    inner = parts[1:-1]
    found = sum(1 for _ in itertools.islice(filter(None, inner), max_segments + 1))  # stops past the limit
    if not found:
        raise SegmentError("blend.separator", "leaves no non-empty segment between separators")
    if found > max_segments:
        raise SegmentError("blend.separator", f"makes more than {max_segments} segments")
    pieces: Pieces = [(parts[0], False)]
    for part in inner:
        pieces += [(separator, False), (part, True)]
    pieces += [(separator, False), (parts[-1], False)]
    return pieces


def join_pieces(pieces: Pieces, encoded: list[list[int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """The prompt's ids (each piece's ``encoded`` ids in order) and the segments' spans."""
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for (_, is_segment), toks in zip(pieces, encoded, strict=True):
        if is_segment and toks:
            spans.append((len(ids), len(ids) + len(toks)))
        ids += toks
    return ids, spans


def encode_pieces(tokenizer: Tokenizer, pieces: Pieces, add_special: bool, *, batch: bool = False) -> list[list[int]]:
    """Each piece's ids: the tokenizer's special tokens (``add_special``) with
    the first piece only, empty pieces none. ``batch``: through the
    tokenizer's batch call (which releases the GIL: for a worker thread)."""
    texts = [p for p, _ in pieces]
    out: list[list[int]] = []
    if add_special and texts:
        out.append(tokenizer.encode(texts[0], True) if not batch else tokenizer.encode_batch(texts[:1], True)[0])
        texts = texts[1:]
    todo = [t for t in texts if t]
    if batch and todo:
        done = iter(tokenizer.encode_batch(todo, False))
    else:
        done = iter([tokenizer.encode(t, False) for t in todo])
    out += [next(done) if t else [] for t in texts]
    return out


def segments_in(tokenizer: Tokenizer, text: str, segments: list[str], *,
                add_special: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and spans of ``segments``, found in ``text`` in order."""
    pieces = segment_pieces(text, segments)
    return join_pieces(pieces, encode_pieces(tokenizer, pieces, add_special))


def split_on(tokenizer: Tokenizer, text: str, separator: str, *,
             add_special: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and spans of the pieces of ``text`` between the first and the last ``separator``."""
    pieces = separator_pieces(text, separator)
    return join_pieces(pieces, encode_pieces(tokenizer, pieces, add_special))
