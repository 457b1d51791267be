"""Summarize py-spy's collapsed stacks (``py-spy record --threads --format
raw``, as tools/gpu_check.sh's stage host_profile writes them) per thread:
the busy samples, and the functions holding the most of them, inclusive and
self. Prints JSON.

Idle samples are left out: a thread waiting in a selector, a condition
variable, an executor's queue or the event loop's run with nothing to do.
A sample counts towards every distinct function on its stack once
(inclusive) and towards its innermost frame (self); file paths are cut to
the package, and the line numbers dropped unless ``--lines``.

    python tools/profile_summary.py host_profile.txt [--top 25] [--match kvstrata] [--lines]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict

# innermost functions of a waiting thread (blocked in C below them)
IDLE = frozenset({"select", "_worker", "wait", "poll", "epoll", "acquire", "_wait_for_tstate_lock", "Runner.run"})


def idle(frame: str) -> bool:
    """Whether a sample whose innermost frame is ``frame`` was a thread waiting."""
    fn = frame.split(" (", 1)[0]
    return fn in IDLE or fn.rsplit(".", 1)[-1] in IDLE
_PATH = re.compile(r" \((?:/[^()]*/)?(kvstrata|site-packages|lib/python3\.\d+)/")


_LINE = re.compile(r":\d+\)$")


def frame_name(frame: str, lines: bool = False) -> str:
    """``fn (/long/path/kvstrata/x.py:12)`` -> ``fn (kvstrata/x.py)`` (with
    ``lines``: ``fn (kvstrata/x.py:12)``, the line the sample was at)."""
    name = _PATH.sub(r" (\1/", frame)
    return name if lines else _LINE.sub(")", name)


def summarize(lines, top: int = 25, match: str | None = None, by_line: bool = False) -> dict:
    busy: Counter[str] = Counter()
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    own: dict[str, Counter[str]] = defaultdict(Counter)
    for line in lines:
        line = line.rstrip("\n")
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread, frames = frames[0], [frame_name(f, by_line) for f in frames[1:]]
        if not frames or any("importlib._bootstrap" in f for f in frames) or idle(frames[-1]):
            continue
        n = int(count)
        busy[thread] += n
        for f in dict.fromkeys(frames):
            if match is None or match in f:
                inclusive[thread][f] += n
        own[thread][frames[-1]] += n
    return {thread: {"busy_samples": total,
                     "inclusive": [[f, n, round(n / total, 3)] for f, n in inclusive[thread].most_common(top)],
                     "self": [[f, n, round(n / total, 3)] for f, n in own[thread].most_common(top)]}
            for thread, total in busy.most_common()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--match", default=None, help="inclusive counts only for frames containing this (e.g. kvstrata)")
    p.add_argument("--lines", action="store_true", help="per line of each function, not per function")
    args = p.parse_args(argv)
    with open(args.path, encoding="utf-8", errors="replace") as f:
        report = summarize(f, args.top, args.match, args.lines)
    json.dump(report, sys.stdout, indent=1)
    print()
    return report


if __name__ == "__main__":
    main()
