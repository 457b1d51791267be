"""Shared builders for the engine-core tests: a scripted fake model runner,
a scripted KV connector, KV managers, a scheduler harness and configs. KV
managers and schedulers come from the engine's own builder
(``kvstrata.enginecore.builder``), from the fake runner's layer specs.

``FakeRunner`` implements the model runner interface with no model: it
keeps its own copy of each request from the SchedulerOutput diffs (tokens,
computed count, block table), checks every diff against that copy, and
samples a token that depends only on the tokens so far, so a preempted and
recomputed request produces the same output as an undisturbed one.

(A module of its own, not conftest.py: test modules import these names, and
``from conftest import`` would find another directory's conftest first when
the whole tree is collected.)
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvstrata.connector.base import NoOpConnectorScheduler
from kvstrata.enginecore.builder import build_block_hasher, build_kv_cache_manager, build_scheduler, cache_identity
from kvstrata.enginecore.request import Request
from kvstrata.enginecore.scheduler import Scheduler
from kvstrata.types import ModelRunnerOutput, SamplingParams, SchedulerOutput
from kvstrata.kv import FullAttentionSpec, KVCacheManager, KVCacheSpec

EOS = 1
VOCAB = 64
FINGERPRINT = "fake-runner-v1"


def fake_layer_specs(block_size: int = 4) -> dict[str, KVCacheSpec]:
    """The fake model's KV: one full-attention layer, 1,024 bytes a block at block size 4."""
    return {"layer.0": FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=32)}


def next_token(tokens: list[int]) -> int:
    """Deterministic in the token sequence alone; never EOS (0 and 1 are skipped)."""
    return (tokens[-1] * 31 + len(tokens) * 7) % (VOCAB - 2) + 2


class RunnerState:
    __slots__ = ("tokens", "num_computed", "block_ids")

    def __init__(self, tokens: list[int], num_computed: int, block_ids: list[int]) -> None:
        self.tokens = tokens
        self.num_computed = num_computed
        self.block_ids = block_ids


class FakeRunner:
    """The runner interface, scripted. ``script[rid]`` overrides the sampled
    tokens of a request, in order; ``fail_steps`` are step indices that raise;
    ``delay_s`` sleeps in the step (the engine's worker thread)."""

    def __init__(
        self,
        *,
        block_size: int = 4,
        max_model_len: int = 256,
        tokenizer=None,
        script: dict[str, list[int]] | None = None,
        fail_steps: set[int] | None = None,
        delay_s: float = 0.0,
        layer_specs: Mapping[str, KVCacheSpec] | None = None,
    ) -> None:
        self.can_blend = False
        self.block_size = block_size
        self.layer_specs = dict(layer_specs or fake_layer_specs(block_size))
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.eos_token_id = EOS
        self.eos_token_ids = (EOS,)
        self.vocab_size = VOCAB if tokenizer is None else max(VOCAB, tokenizer.vocab_size)
        self.model_fingerprint = FINGERPRINT
        self.script = script or {}
        self.fail_steps = fail_steps or set()
        self.delay_s = delay_s
        self.num_blocks = 0
        self.reqs: dict[str, RunnerState] = {}
        self.prompt_len: dict[str, int] = {}
        self.steps: list[dict[str, int]] = []
        # Connector reports to attach to the next step's output.
        self.finished_recving: list[str] = []
        self.finished_sending: list[str] = []

    def kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self.layer_specs

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        step = len(self.steps)
        self.steps.append(dict(so.num_scheduled_tokens))
        if self.delay_s:
            time.sleep(self.delay_s)
        self.apply_diff(so)
        if step in self.fail_steps:
            raise RuntimeError(f"injected failure at step {step}")
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            assert n > 0 and st.num_computed + n <= len(st.tokens)
            assert len(st.block_ids) * self.block_size >= st.num_computed + n
            st.num_computed += n
            req_ids.append(rid)
            if st.num_computed == len(st.tokens):
                script = self.script.get(rid)
                k = len(st.tokens) - self.prompt_len[rid]
                tok = script[k] if script is not None and k < len(script) else next_token(st.tokens)
                st.tokens.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        recving, self.finished_recving = self.finished_recving, []
        sending, self.finished_sending = self.finished_sending, []
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                 finished_recving=recving, finished_sending=sending)

    def apply_diff(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for d in so.scheduled_new_reqs:
            assert d.req_id not in self.reqs, d.req_id
            self.reqs[d.req_id] = RunnerState(list(d.token_ids), d.num_computed_tokens, list(d.block_ids[0]))
            self.prompt_len[d.req_id] = d.num_prompt_tokens
        c = so.scheduled_cached_reqs
        for rid, new_ids, nc in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens, strict=True):
            st = self.reqs[rid]
            assert st.num_computed == nc, (rid, st.num_computed, nc)
            if new_ids is not None:
                st.block_ids.extend(new_ids[0])


class ScriptedConnector(NoOpConnectorScheduler):
    """Answers from ``hits[rid] = (tokens, load_async)``; records every call."""

    def __init__(self, hits=None, delay_free=(), meta=None):
        self.hits = hits or {}
        self.delay_free = set(delay_free)
        self.meta = meta
        self.calls: list[tuple] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("match", request.request_id, num_computed_tokens))
        return self.hits.get(request.request_id, (0, False))

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.calls.append(("alloc", request.request_id, list(block_ids[0]), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        self.calls.append(("meta", dict(scheduler_output.num_scheduled_tokens)))
        return self.meta

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id, list(block_ids[0]) if block_ids else []))
        return request.request_id in self.delay_free, None


def kv_cache_config(num_blocks: int, block_size: int = 4, caching: bool = True) -> CacheConfig:
    return CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching,
                       metrics_sample_rate=0.0)


def make_kv(num_blocks: int, block_size: int = 4, caching: bool = True, max_model_len: int = 256) -> KVCacheManager:
    return build_kv_cache_manager(kv_cache_config(num_blocks, block_size, caching), fake_layer_specs(block_size),
                                  max_model_len=max_model_len)


def make_scheduler(*, num_blocks: int = 64, block_size: int = 4, caching: bool = True, max_model_len: int = 256,
                   connector=None, **sched_cfg) -> Scheduler:
    """A Scheduler over a new KV cache manager (``scheduler.kv``), built as the engine builds it."""
    config = EngineConfig(cache=kv_cache_config(num_blocks, block_size, caching),
                          scheduler=SchedulerConfig(**sched_cfg))
    return build_scheduler(config, fake_layer_specs(block_size), max_model_len=max_model_len, connector=connector)


def hasher_for(block_size: int):
    """The block hasher an engine over a FakeRunner gives its requests."""
    cache = CacheConfig(block_size=block_size)
    return build_block_hasher(cache, cache_identity(cache, fake_layer_specs(block_size), FINGERPRINT),
                              with_connector=False)


class SchedulerHarness:
    """A Scheduler over a real KVCacheManager, driven by a FakeRunner."""

    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, runner: FakeRunner) -> None:
        self.kv = kv
        self.sched = scheduler
        self.runner = runner
        self.hasher = hasher_for(kv.block_size)
        self.outputs: list = []
        self.num_added = 0

    def add(self, rid: str, prompt: list[int] | int, *, max_tokens: int = 4, priority: int = 0,
            arrival: float | None = None, **params) -> Request:
        if isinstance(prompt, int):  # distinct tokens per request: no accidental prefix hits
            self.num_added += 1
            tokens = list(range(1000 * self.num_added, 1000 * self.num_added + prompt))
        else:
            tokens = list(prompt)
        req = Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=(EOS,),
                      arrival_time=arrival if arrival is not None else float(len(self.sched.requests)),
                      priority=priority, block_hasher=self.hasher, hash_block_size=self.kv.block_size)
        self.sched.add_request(req)
        return req

    def step(self) -> SchedulerOutput:
        so = self.sched.schedule()
        out = self.runner.execute_model(so)
        self.outputs.extend(self.sched.update_from_output(so, out))
        return so

    def run_to_completion(self, max_steps: int = 1000) -> int:
        steps = 0
        while self.sched.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps <= max_steps, "requests did not finish"
        self.step()  # deliver the last finished ids to the runner
        return steps


def engine_config(*, num_blocks: int = 64, block_size: int = 4, caching: bool = True, **sched_cfg) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(**sched_cfg),
    )
