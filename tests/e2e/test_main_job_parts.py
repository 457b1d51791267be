"""The parts of `kvstrata run` that need no engine: its workload (the same
chats on every machine), the round turn order, progress off a terminal,
the report's answers and example conversation, the OpenMP wait policy."""

from __future__ import annotations

import asyncio
import io
import os

from kvstrata.bench import workloads as W
from kvstrata.bench.driver import LineProgress, LoadResult, progress_display, run_load
from kvstrata.bench.report import build_report, format_report
from kvstrata.bench.runner import make_workload
from kvstrata.bench.targets import RequestRecord
from kvstrata.cli.main import build_parser
from kvstrata.types import SamplingParams


def test_the_main_jobs_workload_is_the_seeded_chats_whether_or_not_sharegpt_is_installed():
    args = build_parser().parse_args(["run"])
    assert (args.workload, args.turn_order, args.num_requests, args.turns) == ("chat", "round", 12, 3)
    convs = make_workload(args)
    assert convs == make_workload(build_parser().parse_args(["run"]))
    assert convs != W.chat(12, turns=3, output_len=args.output_len, seed=1)
    assert {c.system for c in convs} == {W.CHAT_SYSTEM}
    for c in convs:
        users = [t.user for t in c.turns]
        assert len(users) == 3 == len(set(users)) and set(users) <= set(W.CHAT_QUESTIONS)
        assert not c.ignore_eos and c.stop == ["\nUser:"]


class _EchoTarget:
    """Answers every prompt at once with the question it ends with."""

    name = "echo"

    def __init__(self) -> None:
        self.params: list[SamplingParams] = []

    async def request(self, prompt: str, params: SamplingParams, rec: RequestRecord) -> str:
        self.params.append(params)
        await asyncio.sleep(0)
        rec.prompt_tokens, rec.cached_tokens = len(prompt), 0
        rec.chunk_times, rec.chunk_tokens = [rec.start + 0.01], [1]
        rec.first_token, rec.end = rec.start + 0.01, rec.start + 0.02
        return " answer to " + prompt.rsplit("User: ", 1)[1].removesuffix("\nAssistant:")

    async def stats(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


def test_round_order_plays_every_chats_turn_before_the_next_in_a_seeded_order():
    convs = W.chat(5, turns=3, output_len=(4, 4), seed=0)

    def order(seed: int) -> list[tuple[int, str]]:
        target = _EchoTarget()
        result = asyncio.run(run_load(target, convs, concurrency=1, progress=False, seed=seed, turn_order="round"))
        assert all(not p.ignore_eos and p.stop == ["\nUser:"] for p in target.params)
        return [(r.turn, r.conv_id) for r in result.records]

    played = order(0)
    assert [t for t, _ in played] == [0] * 5 + [1] * 5 + [2] * 5
    assert [c for _, c in played[:5]] == [f"chat{i}" for i in range(5)]  # the first round in workload order
    assert {c for _, c in played[5:10]} == {f"chat{i}" for i in range(5)}
    assert played == order(0) and played != order(1)


def test_progress_off_a_terminal_is_a_line_per_ten_percent_with_no_redraws():
    out = io.StringIO()
    assert isinstance(progress_display(20, "turns", enabled=True, stream=out), LineProgress)
    bar = LineProgress(20, "turns", out)
    for _ in range(20):
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" in ")[0] for line in lines] == [f"turns: {2 * i}/20 ({10 * i}%)" for i in range(1, 11)]
    assert "\r" not in out.getvalue()


def test_the_report_shows_a_few_answers_then_one_whole_conversation():
    convs = W.chat(3, turns=2, output_len=(4, 4), seed=0)
    result = asyncio.run(run_load(_EchoTarget(), convs, progress=False, turn_order="round"))
    report = build_report(result, None, None)
    assert [(a["conversation"], a["turn"]) for a in report["answers"]] == [("chat0", 1), ("chat1", 2), ("chat2", 2)]
    first = report["answers"][0]
    assert first["answer"] == f"answer to {convs[0].turns[0].user}" and first["ttft_ms"] == 10.0
    example = report["example_conversation"]
    assert example["conversation"] == "chat0"
    assert [m["content"] for m in example["messages"]] == [
        convs[0].turns[0].user, f"answer to {convs[0].turns[0].user}",
        convs[0].turns[1].user, f"answer to {convs[0].turns[1].user}"]
    text = format_report(report).splitlines()
    assert text[text.index("example conversation (chat0):") + 2] == f"  user       {convs[0].turns[0].user}"
    assert text[-1] == f"  assistant  answer to {convs[0].turns[1].user}"


def test_a_failed_turn_leaves_its_conversation_out_of_the_example():
    ok = RequestRecord(conv_id="b", turn=0, start=0.0, user="q", reply="a", end=1.0)
    failed = RequestRecord(conv_id="a", turn=0, start=0.0, user="q", error="HTTP 500", end=1.0)
    convs = [W.Conversation("a", [W.Turn("q", 4)]), W.Conversation("b", [W.Turn("q", 4)])]
    report = build_report(LoadResult([failed, ok], 0.0, 1.0, convs), None, None)
    assert report["example_conversation"]["conversation"] == "b"
    assert [a["conversation"] for a in report["answers"]] == ["b"]


def test_the_command_makes_openmp_threads_wait_passively_unless_told_otherwise(monkeypatch):
    from kvstrata.cli.main import quiet_waiting_threads

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    quiet_waiting_threads()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    quiet_waiting_threads()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
