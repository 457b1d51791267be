"""A freshly started engine process for the connector tests (``python
engine_proc.py '<json>'``): builds an AsyncEngine over the given checkpoint
and KV-transfer config, generates greedily for each prompt in turn, and
prints one JSON line: the tokens per prompt and the engine's stats."""

from __future__ import annotations

import asyncio
import json
import sys

import msgspec

from kvstrata.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from kvstrata.enginecore import AsyncEngine, SamplingParams


async def main(args: dict) -> dict:
    config = EngineConfig(
        model=ModelConfig(model=args["model"]),
        cache=CacheConfig(block_size=args["block_size"], num_blocks=args.get("num_blocks", 64)),
        kv_transfer=msgspec.convert(args["kv_transfer"], KVTransferConfig), device="cpu", log_level="WARNING",
    )
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"])
    async with await AsyncEngine.start(config) as engine:
        tokens = []
        for p in args["prompts"]:
            tokens.append([t async for out in engine.generate(p, params) for t in out.new_token_ids])
        await engine.flush_kv()
        stats = await engine.stats()
    return {"tokens": tokens, "extra": stats.extra, "prefix_cache_hits": stats.prefix_cache_hits}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))))
