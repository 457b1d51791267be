"""`kvstrata run`, the README's first command: the engine subprocess with the
default model (SmolLM2-135M-Instruct's GGUF, fetched into the cache once), a
small slice of the default chat workload, the printed report with the
model's answers, and a second run that finds the first one's KV on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _kvstrata(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstrata", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "KVSTRATA_LOG_LEVEL": "INFO"})


# 2 chats of 2 turns, 4 tokens per answer: the smallest run whose second
# turns reuse the first ones' KV
_SMALL_JOB = ("--num-requests", "2", "--turns", "2", "--output-len", "4:4")


def test_main_job_shows_the_answers_and_a_second_run_finds_the_kv_on_disk(tmp_path):
    store = str(tmp_path / "kv")
    runs = []
    for n in (1, 2):
        out = tmp_path / f"run{n}.json"
        proc = _kvstrata("run", *_SMALL_JOB, "--kv-store-dir", store, "--output", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append((proc, json.loads(out.read_text())))
    (first, cold), (second, warm) = runs

    assert (cold["num_requests"], cold["num_completed"], cold["num_errors"]) == (4, 4, 0)
    assert cold["executor"] == "model" and cold["target"] == "zmq" and cold["workload"] == "chat"
    assert cold["preemptions"] == 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(cold[key]) == {"mean", "p50", "p90", "p99"}
    # the second turns extend the first ones: device hits; nothing on disk yet
    assert cold["prefix_cache"]["device"]["hit_tokens"] > 0
    assert cold["prefix_cache"]["disk"]["hit_tokens"] == 0
    # a fresh engine (cold device cache, empty CPU tier) finds the same chats on disk
    assert warm["prefix_cache"]["disk"]["hit_tokens"] > 0
    assert warm["prompt_tokens"] == cold["prompt_tokens"]  # the same seeded chats, not ShareGPT's
    assert [a["prompt"] for a in warm["answers"]] == [a["prompt"] for a in cold["answers"]]

    # what the model answered: a few turns, then one whole conversation
    answers = cold["answers"]
    assert [(a["conversation"], a["turn"]) for a in answers] == [("chat0", 1), ("chat1", 2)]
    assert all(a["prompt"].endswith("?") or a["prompt"].endswith(".") for a in answers)
    assert all(a["answer"] for a in answers)
    example = cold["example_conversation"]
    assert example["conversation"] == "chat0" and "Riverside Public Library" in example["system"]
    assert [m["role"] for m in example["messages"]] == ["user", "assistant"] * 2
    text = first.stdout
    assert "requests        4/4 ok" in text and "hit rate disk" in text
    assert "answers         2 of 4 turns" in text and f"{answers[0]['prompt']!r} -> " in text
    assert text.rstrip().splitlines()[-1].startswith("The disk tier keeps")
    assert "example conversation (chat0):" in text and "  assistant  " in text
    assert "empty" in text and "MiB stored by earlier runs" in second.stdout

    # off a terminal: logs on stderr only, progress as whole lines, no redraws
    for proc in (first, second):
        assert '"event"' not in proc.stdout and '"engine_ready"' in proc.stderr
        assert "\r" not in proc.stderr
        assert "turns: 4/4 (100%)" in proc.stderr


def test_config_errors_name_the_field_and_exit_2():
    proc = _kvstrata("run", "--scheduler.max-num-seqs", "0")
    assert proc.returncode == 2
    assert "scheduler.max_num_seqs" in proc.stderr
