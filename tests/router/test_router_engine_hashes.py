"""The router hashes a prompt exactly as the engine does: its hashes equal
the hashes of the BlockStored events a real engine core (builder, Request,
KVCacheManager; a scripted model runner) emits for that prompt, and those
events, through msgpack as the publisher sends them, make the router send
the prompt back to the replica that cached it."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "enginecore"))
from engine_fakes import FakeRunner  # noqa: E402

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from kvstrata.enginecore.builder import build_engine_core  # noqa: E402
from kvstrata.enginecore.engine_core import EngineCore  # noqa: E402
from kvstrata.enginecore.request import EngineRequest  # noqa: E402
from kvstrata.kv.events import BlockStored, KVEventBatch, make_batch_decoder  # noqa: E402
from kvstrata.router import GPU, Router  # noqa: E402
from kvstrata.types import SamplingParams  # noqa: E402

BS = 4


def make_core(hash_algo: str) -> EngineCore:
    cache = CacheConfig(block_size=BS, num_blocks=64, hash_algo=hash_algo, kv_events_endpoint="tcp://127.0.0.1:*")
    return build_engine_core(EngineConfig(model=ModelConfig(), cache=cache), FakeRunner(block_size=BS))


def run(core: EngineCore, rid: str, prompt: list[int], sink: list[KVEventBatch]) -> None:
    """Serve one request to the end, collecting each step's events as the
    publisher would send them (msgpack, decoded on the other side)."""
    core.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt,
                                   sampling_params=SamplingParams(max_tokens=2)))
    decode = make_batch_decoder().decode
    for _ in range(50):
        core.step()
        events = core.take_kv_events()
        if events:
            sink.append(decode(msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))))
        if not core.has_work():
            return
    raise AssertionError("engine did not drain")


@pytest.mark.parametrize("hash_algo", ["sha256", "xxhash", "sha256_cbor"])
def test_router_hashes_equal_the_engines_and_route_the_prompt_home(hash_algo):
    cores = {"a": make_core(hash_algo), "b": make_core(hash_algo)}
    router = Router(cores["a"].identity)
    for name in cores:
        router.reset_replica(name, epoch=1)
    prompts = {"a": list(range(10, 10 + 6 * BS + 2)), "b": list(range(200, 200 + 5 * BS))}
    for name, core in cores.items():
        batches: list[KVEventBatch] = []
        run(core, f"r-{name}", prompts[name], batches)
        stored = [h for b in batches for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes]
        assert {e.medium for b in batches for e in b.events} == {GPU}
        n = len(prompts[name]) // BS
        assert router.hash_prompt(prompts[name]) == stored[:n]  # same bytes, same order
        for seq, b in enumerate(batches):
            assert router.ingest(name, seq, b, epoch=1).action == "applied"
        assert core.kv.num_free_blocks == core.kv.block_pool.num_blocks - 1  # all back (block 0 is the null block)
    for name, prompt in prompts.items():
        d = router.choose(router.hash_prompt(prompt), num_tokens=len(prompt))
        assert (d.replica, d.hit_tokens, d.device_hit_tokens) == (name, len(prompt) // BS * BS, len(prompt) // BS * BS)


def test_a_different_cache_identity_hashes_differently():
    core = make_core("sha256")
    other = Router(msgspec.structs.replace(core.identity, model_fingerprint="another-model"))
    assert other.hash_prompt(list(range(8))) != Router(core.identity).hash_prompt(list(range(8)))
