"""What the model answered, for the report: a few turns (the user's message
and the reply, cut to a line each) and one whole conversation.

The picks are deterministic: conversation k's turn k (the k-th turn of a
later conversation has more history, so more cached prompt tokens), and the
first conversation, in workload order, whose every turn succeeded.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from kvstrata.bench.driver import LoadResult
from kvstrata.bench.targets import RequestRecord

# The load-test report: plain JSON, written out whole and read back by key.
# Any: its values are numbers, strings, lists and nested reports of fixed shapes.
Report: TypeAlias = dict[str, Any]

EXCERPT_CHARS = 72
MESSAGE_CHARS = 400


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """``text`` on one line (whitespace runs collapsed), cut at ``limit`` characters with an ellipsis."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 1].rstrip() + "…"


def _ok_by_conversation(result: LoadResult) -> tuple[list[str], dict[str, dict[int, RequestRecord]]]:
    order = [c.conv_id for c in result.convs] or list(dict.fromkeys(r.conv_id for r in result.records))
    turns: dict[str, dict[int, RequestRecord]] = {}
    for r in result.records:
        if r.error is None:
            turns.setdefault(r.conv_id, {})[r.turn] = r
    return order, turns


def sample_turns(result: LoadResult, n: int = 4) -> list[Report]:
    """Up to ``n`` turns: conversation k's turn k (its last one if shorter)."""
    order, turns = _ok_by_conversation(result)
    out = []
    for k, conv_id in enumerate(order[:n]):
        done = turns.get(conv_id)
        if not done:
            continue
        r = done.get(k) or done[max(done)]
        ttft = round(1000 * (r.first_token - r.start), 1) if r.first_token is not None else None
        out.append({"conversation": conv_id, "turn": r.turn + 1, "prompt": excerpt(r.user),
                    "answer": excerpt(r.reply), "prompt_tokens": r.prompt_tokens,
                    "cached_tokens": r.cached_tokens, "ttft_ms": ttft})
    return out


def example_conversation(result: LoadResult) -> Report | None:
    """The first conversation whose turns all succeeded, message by message
    (each cut at ``MESSAGE_CHARS``; the shared system prompt to a line)."""
    order, turns = _ok_by_conversation(result)
    convs = {c.conv_id: c for c in result.convs}
    for conv_id in order:
        conv = convs.get(conv_id)
        done = turns.get(conv_id, {})
        want = len(conv.turns) if conv is not None else len(done)
        if not done or len(done) != want:
            continue
        messages = []
        for i in sorted(done):
            messages += [{"role": "user", "content": excerpt(done[i].user, MESSAGE_CHARS)},
                         {"role": "assistant", "content": excerpt(done[i].reply, MESSAGE_CHARS)}]
        system = excerpt(conv.system, 96) if conv is not None and conv.system else ""
        return {"conversation": conv_id, "system": system, "messages": messages}
    return None


def format_transcripts(report: Report) -> list[str]:
    """The answers and the example conversation as report lines."""
    lines: list[str] = []
    samples = report.get("answers") or []
    if samples:
        lines.append(f"answers         {len(samples)} of {report['num_completed']} turns (prompt -> answer):")
        for s in samples:
            lines.append(f"  {s['conversation']} turn {s['turn']}: {s['prompt']!r} -> {s['answer']!r}")
            lines.append(f"    {s['prompt_tokens']} prompt tokens, {s['cached_tokens']} cached; "
                         f"first token after {s['ttft_ms']} ms")
    example = report.get("example_conversation")
    if example:
        lines.append(f"example conversation ({example['conversation']}):")
        if example["system"]:
            lines.append(f"  {'system':<10} {example['system']}")
        lines += [f"  {m['role']:<10} {m['content']}" for m in example["messages"]]
    return lines
