"""tools/disagg_prefill.py end to end: a prefill engine process and a decode
engine process sharing a real redis-server; the decode engine loads all but
the prompt's last token from Redis and continues exactly as HF would."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

import pytest
from conn_helpers import redis_available

TOOL = Path(__file__).resolve().parents[2] / "tools" / "disagg_prefill.py"


async def test_disaggregated_prefill_over_redis(oracle):
    if not redis_available():
        pytest.skip("redis-server not installed")
    args = ["--model", oracle.path, "--requests", "2", "--prompt-tokens", "61", "--output-tokens", "6",
            "--block-size", "4", "--chunk-size", "16", "--num-blocks", "64", "--seed", "3"]
    proc = await asyncio.create_subprocess_exec(sys.executable, str(TOOL), *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 0, err.decode()[-2000:]
    report = json.loads(out)
    assert report["all_first_tokens_match"] is True
    rng = random.Random(3)
    for r in report["results"]:
        p = [rng.randint(1, 255) for _ in range(61)]
        [rng.randint(1, 255) for _ in range(61)]  # the "cold" prompt drawn after it
        assert r["loaded_from_redis_tokens"] == 60  # 15 full blocks: all but the last token
        expected = oracle.greedy(p, 6)
        assert r["tokens"][: len(expected)] == expected
