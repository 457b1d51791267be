"""Every EOS id stops a request: config.json's (an int or a list) and those
only generation_config.json lists (instruct checkpoints name their
end-of-turn token there); a malformed list names the file."""

from __future__ import annotations

import json

import pytest
from hf_utils import build_tiny_llama, hf_greedy

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig
from kvstrata.enginecore import AsyncEngine
from kvstrata.types import SamplingParams
from kvstrata.worker.model import CheckpointError, load_checkpoint

PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-eos")
    model = build_tiny_llama(d)
    return d, hf_greedy(model, PROMPT, 8)


async def _generate(path) -> list:
    cfg = EngineConfig(model=ModelConfig(model=str(path), max_model_len=128), cache=CacheConfig(block_size=4, num_blocks=64),
                       device="cpu", log_level="WARNING")
    engine = await AsyncEngine.start(cfg)
    try:
        return [o async for o in engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))]
    finally:
        await engine.aclose()


async def test_an_eos_only_generation_config_lists_stops_the_request(tiny, tmp_path):
    src, greedy = tiny
    assert 257 not in greedy[:3]
    d = tmp_path / "ckpt"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    full = await _generate(d)
    assert [t for o in full for t in o.new_token_ids] == greedy
    end_of_turn = greedy[2]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, end_of_turn]}))
    assert end_of_turn in load_checkpoint(str(d)).arch.eos_token_ids
    outs = await _generate(d)
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == greedy[:greedy.index(end_of_turn) + 1]
    assert outs[-1].finish_reason == "stop"


def test_a_malformed_generation_config_names_the_file(tiny, tmp_path):
    src, _ = tiny
    d = tmp_path / "bad"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    with pytest.raises(CheckpointError, match="generation_config.json.*eos_token_id"):
        load_checkpoint(str(d))
