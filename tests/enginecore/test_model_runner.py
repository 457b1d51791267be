"""ModelRunner driven by hand-built SchedulerOutputs, against HF ``generate``.

``StepDriver`` stands in for the scheduler only to *build* SchedulerOutputs
(new requests in full, running ones as deltas, block ids from a counter,
prefills chunked under a token budget); everything it drives is the real
runner, model, kernels and sampler.
"""

from __future__ import annotations

import pytest
import torch
from hf_utils import build_tiny_llama, hf_greedy, hf_logits

from kvstrata.config import CacheConfig, ModelConfig
from kvstrata.enginecore.builder import kv_bytes_per_block, kv_cache_groups, num_blocks_for_memory
from kvstrata.kv import FullAttentionSpec
from kvstrata.worker.model_runner import ModelRunner
from kvstrata.worker.null_runner import NullModelRunner
from kvstrata.text.tokenizer import ByteTokenizer
from kvstrata.types import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


class _Req:
    def __init__(self, req_id, prompt, params, blocks, num_computed):
        self.req_id, self.params = req_id, params
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.blocks = list(blocks)
        self.num_computed = num_computed
        self.sent = False
        self.outputs: list[int] = []
        self.done = False


class StepDriver:
    def __init__(self, runner, budget: int = 1000, eos: int = 257, first_block: int = 1, block_size: int = BS):
        self.runner, self.budget, self.eos, self.block_size = runner, budget, eos, block_size
        self.next_block = first_block
        self.reqs: dict[str, _Req] = {}
        self.finished: list[str] = []
        self.preempted: list[str] = []
        self.outputs = []

    def add(self, req_id, prompt, params=GREEDY, blocks=(), num_computed=0):
        self.reqs[req_id] = _Req(req_id, prompt, params, blocks, num_computed)
        return self.reqs[req_id]

    def preempt(self, req_id):
        r = self.reqs[req_id]
        r.sent, r.blocks, r.num_computed = False, [], 0
        self.preempted.append(req_id)

    def step(self):
        budget, sched, new, cached = self.budget, {}, [], CachedRequestData()
        c_ids, c_blocks, c_computed = [], [], []
        for r in self.reqs.values():
            n = min(len(r.tokens) - r.num_computed, budget)
            if r.done or n <= 0:
                continue
            fresh = []
            while len(r.blocks) * self.block_size < r.num_computed + n:
                fresh.append(self.next_block)
                r.blocks.append(self.next_block)
                self.next_block += 1
            if not r.sent:
                new.append(NewRequestData(req_id=r.req_id, token_ids=list(r.tokens), num_prompt_tokens=r.num_prompt,
                                          sampling_params=r.params, block_ids=(list(r.blocks),),
                                          num_computed_tokens=r.num_computed))
                r.sent = True
            else:
                c_ids.append(r.req_id)
                c_blocks.append((fresh,) if fresh else None)
                c_computed.append(r.num_computed)
            sched[r.req_id] = n
            budget -= n
        cached = CachedRequestData(req_ids=c_ids, new_block_ids=c_blocks, num_computed_tokens=c_computed)
        so = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=sched,
                             total_num_scheduled_tokens=sum(sched.values()), finished_req_ids=self.finished,
                             preempted_req_ids=self.preempted)
        self.finished, self.preempted = [], []
        out = self.runner.execute_model(so)
        assert out.req_ids == list(sched)
        for req_id, toks in zip(out.req_ids, out.sampled_token_ids):
            r = self.reqs[req_id]
            r.num_computed += sched[req_id]
            r.tokens += toks
            r.outputs += toks
            if toks and (len(r.outputs) >= r.params.max_tokens or toks[-1] == self.eos):
                r.done = True
                self.finished.append(req_id)
        self.outputs.append(out)
        return out

    def run(self, max_steps: int = 500):
        for _ in range(max_steps):
            if all(r.done for r in self.reqs.values()):
                return {rid: r.outputs for rid, r in self.reqs.items()}
            self.step()
        raise AssertionError("requests did not finish")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return str(d), build_tiny_llama(d)


def make_runner(path, num_blocks=256, **cache):
    runner = ModelRunner(ModelConfig(model=path), CacheConfig(block_size=BS, **cache))
    runner.initialize_kv_cache(num_blocks)
    return runner


PROMPTS = {
    "a": [256, 5, 9, 200, 31],
    "b": [256, *range(40, 52)],
    "c": [256, *[(i * 37) % 250 for i in range(28)]],
    "d": [256, *[(i * 11) % 255 for i in range(39)]],
}


def test_batch_with_chunked_prefill_matches_hf_greedy(tiny):
    path, hf = tiny
    driver = StepDriver(make_runner(path), budget=16)
    for rid, prompt in PROMPTS.items():
        driver.add(rid, prompt)
    got = driver.run()
    partial = [o for o in driver.outputs if any(len(t) == 0 for t in o.sampled_token_ids)]
    assert partial, "the budget must have forced chunked prefills"
    mixed = [o for o in driver.outputs if {0, 1} <= {len(t) for t in o.sampled_token_ids}]
    assert mixed, "a step must mix a partial prefill with sampled requests"
    for rid, prompt in PROMPTS.items():
        assert got[rid] == hf_greedy(hf, prompt, GREEDY.max_tokens), rid


def test_prefix_cache_hit_reuses_shared_blocks(tiny):
    path, hf = tiny
    prefix = PROMPTS["d"][:24]  # 6 full blocks
    driver = StepDriver(make_runner(path))
    a = driver.add("a", prefix + [7, 7, 7])
    driver.step()  # a's prompt is now in blocks a.blocks
    driver.step()
    # b and c arrive while a still decodes, their first 5 blocks taken from a's.
    b = driver.add("b", prefix + [99, 98], blocks=a.blocks[:5], num_computed=20)
    c = driver.add("c", prefix[:21], blocks=a.blocks[:5], num_computed=20)  # hit ends mid-block 6 of 6
    got = driver.run()
    assert b.blocks[:5] == a.blocks[:5] and c.blocks[:5] == a.blocks[:5]
    assert got["a"] == hf_greedy(hf, prefix + [7, 7, 7], GREEDY.max_tokens)
    assert got["b"] == hf_greedy(hf, prefix + [99, 98], GREEDY.max_tokens)
    assert got["c"] == hf_greedy(hf, prefix[:21], GREEDY.max_tokens)


def test_preempted_request_resumes_with_its_outputs(tiny):
    path, hf = tiny
    driver = StepDriver(make_runner(path))
    r = driver.add("p", PROMPTS["c"])
    for _ in range(4):
        driver.step()
    assert len(r.outputs) == 4
    driver.preempt("p")  # runner drops it; it comes back as new with prompt + 4 outputs
    got = driver.run()
    assert got["p"] == hf_greedy(hf, PROMPTS["c"], GREEDY.max_tokens)
    assert len(driver.runner.batch) == 1
    assert driver.step().req_ids == []  # an empty step that only carries finished_req_ids
    assert len(driver.runner.batch) == 0  # finished requests leave the persistent batch


def test_partial_prefill_samples_nothing(tiny):
    path, _ = tiny
    driver = StepDriver(make_runner(path), budget=10)
    driver.add("b", PROMPTS["b"])  # 13 tokens: 10, then 3 + sample
    first = driver.step()
    second = driver.step()
    assert first.sampled_token_ids == [[]] and first.logprobs is None
    assert len(second.sampled_token_ids[0]) == 1


def test_cross_layer_layout_gives_the_same_tokens(tiny):
    path, hf = tiny
    driver = StepDriver(make_runner(path, kv_layout="cross_layer"), budget=12)
    driver.add("c", PROMPTS["c"])
    driver.add("a", PROMPTS["a"])
    got = driver.run()
    assert got["c"] == hf_greedy(hf, PROMPTS["c"], GREEDY.max_tokens)
    assert got["a"] == hf_greedy(hf, PROMPTS["a"], GREEDY.max_tokens)


def test_logprobs_are_those_of_the_model(tiny):
    path, hf = tiny
    driver = StepDriver(make_runner(path))
    driver.add("l", PROMPTS["b"], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3))
    driver.add("n", PROMPTS["a"], SamplingParams(temperature=0.0, max_tokens=1))
    out = driver.step()
    lp, none = out.logprobs
    assert none is None
    ref = torch.log_softmax(hf_logits(hf, PROMPTS["b"])[-1], dim=-1)
    top = ref.topk(3)
    assert lp.token_ids == [out.sampled_token_ids[0][0], *top.indices.tolist()]
    assert lp.token_ids[0] == lp.token_ids[1] and lp.sampled_rank == 0
    torch.testing.assert_close(torch.tensor(lp.logprobs), torch.tensor([top.values[0], *top.values]), atol=1e-5, rtol=0)


def _seeded_tokens(path, others: int, preempt_at: int | None) -> list[int]:
    driver = StepDriver(make_runner(path))
    params = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=12)
    req = driver.add("s", PROMPTS["c"], params)
    for i in range(others):
        driver.add(f"o{i}", PROMPTS["d"][: 10 + i], SamplingParams(temperature=0.8, max_tokens=12))
    while not req.done:
        if preempt_at is not None and len(req.outputs) == preempt_at:
            driver.preempt("s")
            preempt_at = None
        driver.step()
    return req.outputs


def test_seeded_request_ignores_batch_and_preemption(tiny):
    path, _ = tiny
    alone = _seeded_tokens(path, others=0, preempt_at=None)
    assert len(set(alone)) > 3  # actually random, not greedy
    assert _seeded_tokens(path, others=3, preempt_at=None) == alone
    assert _seeded_tokens(path, others=2, preempt_at=5) == alone


def test_unseeded_random_requests_differ(tiny):
    path, _ = tiny
    driver = StepDriver(make_runner(path))
    params = SamplingParams(temperature=1.5, max_tokens=12)
    driver.add("x", PROMPTS["a"], params)
    driver.add("y", PROMPTS["a"], params)
    got = driver.run()
    assert got["x"] != got["y"]


def test_runner_properties_and_kv_spec(tiny):
    path, _ = tiny
    runner = ModelRunner(ModelConfig(model=path, max_model_len=256), CacheConfig(block_size=BS))
    assert isinstance(runner.tokenizer, ByteTokenizer)
    assert (runner.max_model_len, runner.vocab_size, runner.eos_token_id) == (256, 320, 257)
    specs = runner.kv_cache_spec()  # per layer, kvstrata.kv's specs: every Llama layer is full attention
    assert list(specs) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert set(specs.values()) == {FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=16, dtype="float32")}
    assert kv_bytes_per_block(specs) == 2 * 2 * 4 * 2 * 16 * 4
    assert num_blocks_for_memory(specs, 1) == 1024 * 1024 // 2048
    [group] = kv_cache_groups(specs)
    assert group.layer_names == list(specs)
    with pytest.raises(RuntimeError, match="initialize_kv_cache"):
        runner.execute_model(SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
                                             num_scheduled_tokens={}, total_num_scheduled_tokens=0))
    runner.initialize_kv_cache(10)
    assert len(runner.kv_caches) == 2 and runner.kv_caches[0][0].shape == (10, 4, 2, 16)


def test_max_model_len_beyond_checkpoint_is_refused(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match=r"model.max_model_len \(4096\) exceeds.*\(512\)"):
        ModelRunner(ModelConfig(model=path, max_model_len=4096), CacheConfig())


def test_default_model_runs_with_byte_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path))
    runner = ModelRunner(ModelConfig(model=None), CacheConfig(block_size=16))
    assert isinstance(runner.tokenizer, ByteTokenizer)
    assert (runner.vocab_size, runner.eos_token_id, runner.max_model_len) == (258, 257, 8192)
    specs = runner.kv_cache_spec()
    assert len(specs) == 8
    assert {(s.num_kv_heads, s.head_size) for s in specs.values()} == {(4, 64)}
    runner.initialize_kv_cache(8)
    driver = StepDriver(runner, block_size=16)
    driver.add("r", runner.tokenizer.encode("hello, world"), SamplingParams(temperature=0.0, max_tokens=3))
    assert len(driver.run()["r"]) == 3


def test_null_runner_matches_interface_without_a_model(tiny):
    path, _ = tiny
    null = NullModelRunner(ModelConfig(model=path), CacheConfig(block_size=BS))
    real = ModelRunner(ModelConfig(model=path), CacheConfig(block_size=BS))
    assert null.kv_cache_spec() == real.kv_cache_spec()
    assert (null.max_model_len, null.vocab_size, null.eos_token_id) == (real.max_model_len, 320, 257)
    assert num_blocks_for_memory(null.kv_cache_spec(), 1) == num_blocks_for_memory(real.kv_cache_spec(), 1)
    null.initialize_kv_cache(64)
    driver = StepDriver(null, budget=8)
    driver.add("a", PROMPTS["a"], SamplingParams(max_tokens=4))   # 5 tokens
    driver.add("b", PROMPTS["b"], SamplingParams(max_tokens=3))   # 13 tokens, chunked
    got = driver.run()
    # letters a..z by position: a's outputs sit at positions 5..8, b's at 13..15
    assert got["a"] == [97 + 5, 97 + 6, 97 + 7, 97 + 8]
    assert got["b"] == [97 + 13, 97 + 14, 97 + 15]
    assert driver.outputs[0].sampled_token_ids == [[97 + 5], []]


def test_triton_interpreted_kernels_give_the_same_tokens(tiny, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernels dispatch to the Triton interpreter per call
    path, hf = tiny
    driver = StepDriver(make_runner(path, num_blocks=16), budget=4)  # a 4-token chunk, then extend + decode
    driver.add("a", PROMPTS["a"], SamplingParams(temperature=0.0, max_tokens=3))
    assert driver.run()["a"] == hf_greedy(hf, PROMPTS["a"], 3)


@pytest.mark.parametrize(("max_seqs", "drafts", "max_rows"), [(160, 0, 160), (40, 2, 120), (8, 0, 8)])
def test_warm_up_runs_the_lm_head_on_every_count_of_sampled_rows(tiny, max_seqs, drafts, max_rows):
    """The head's tiles (N: the vocabulary) compile at start too: warm_up
    runs it on each row count of warm_up_logits_rows, after the forwards,
    up to the most rows a step samples (one per sequence and draft)."""
    from kvstrata.config import SchedulerConfig
    from kvstrata.worker.model_runner import warm_up_logits_rows

    runner = ModelRunner(ModelConfig(model=tiny[0]), CacheConfig(block_size=BS), "cpu",
                         SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=max_seqs), max_drafts=drafts)
    assert runner.max_logits_rows == max_rows
    runner.initialize_kv_cache(64)
    head = runner.model.compute_logits
    rows: list[int] = []

    def spy(hidden):
        rows.append(hidden.shape[0])
        return head(hidden)

    runner.model.compute_logits = spy
    runner.warm_up()
    assert rows == warm_up_logits_rows(max_rows) and rows[0] == 1 and rows[-1] == min(max_rows, 128)


def test_num_threads_sets_torch_intra_op_threads(tiny):
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    try:
        ModelRunner(ModelConfig(model=tiny[0], num_threads=target), CacheConfig(block_size=BS))
        assert torch.get_num_threads() == target
    finally:
        torch.set_num_threads(before)


def test_graph_sizes_stay_within_both_step_limits(tiny):
    from kvstrata.config import SchedulerConfig

    runner = ModelRunner(ModelConfig(model=tiny[0]), CacheConfig(block_size=BS), "cpu",
                         SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=64))
    assert runner.graph_sizes == [1, 2, 4, 8] and not runner.use_cuda_graphs  # never on a CPU
    runner.initialize_kv_cache(32)
    graphs = runner.capture_decode_graphs([1, 2, 4, 8, 16], emulate=True)
    assert graphs.sizes == [1, 2, 4, 8]  # a 16-row decode step would exceed the 8-token budget


def test_graphs_fused_kernels_and_split_decode_default_on_for_cuda():
    """None: on for CUDA (an H200 run showed the oracle identical with each,
    every family); a CPU never captures graphs and runs its own decode kernel."""
    from kvstrata.worker.model_runner import on_for_cuda, wants_cuda_graphs, wants_fused_kernels

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert wants_cuda_graphs(None, cuda) and wants_cuda_graphs(True, cuda) and not wants_cuda_graphs(False, cuda)
    assert not wants_cuda_graphs(None, cpu) and not wants_cuda_graphs(True, cpu)
    assert wants_fused_kernels(None, cuda) and not wants_fused_kernels(False, cuda)
    assert on_for_cuda(None, cuda) and not on_for_cuda(False, cuda)
    assert not on_for_cuda(None, cpu) and on_for_cuda(True, cpu)


def test_fused_kernels_default_to_the_c_ones_on_a_cpu(tiny, monkeypatch):
    from kvstrata.kernels.fused_native import fused_kernels

    path, _ = tiny
    runner = make_runner(path)
    assert runner.fused_kernels == (fused_kernels() is not None)
    assert all(layer.fused == runner.fused_kernels for layer in runner.model.model.layers)
    off = ModelRunner(ModelConfig(model=path, fused_kernels=False), CacheConfig(block_size=BS))
    assert not off.fused_kernels and not any(layer.fused for layer in off.model.model.layers)
    off.initialize_kv_cache(256)
    outs = []
    for r in (runner, off):  # the same greedy tokens either way (the HF oracle: tests/enginecore/test_oracle.py)
        driver = StepDriver(r, budget=16)
        for rid, prompt in PROMPTS.items():
            driver.add(rid, prompt)
        outs.append(driver.run())
    assert outs[0] == outs[1]
    assert not runner.split_decode  # a CPU's decode kernel is its own
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter would run the Triton ones: not by default
    assert not ModelRunner(ModelConfig(model=path), CacheConfig(block_size=BS)).fused_kernels


def test_the_first_layer_of_a_step_checks_its_arguments_and_the_others_skip_them(tiny):
    from kvstrata.kernels import KernelArgumentError
    from kvstrata.worker.model.attention import AttentionMetadata

    path, _ = tiny
    runner = make_runner(path, num_blocks=8)

    def meta(slot):
        return AttentionMetadata(slot_mapping=torch.tensor([slot]), block_tables=torch.tensor([[1]], dtype=torch.int32),
                                 query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                                 seq_lens=torch.tensor([1], dtype=torch.int32))

    ids, pos = torch.tensor([5]), torch.tensor([0])
    bad = meta(8 * BS)  # one past the cache: caught by the first layer, before anything is written
    with pytest.raises(KernelArgumentError, match="slot_mapping has slot"):
        runner.model(ids, pos, bad, runner.kv_caches)
    assert not bad.checked
    good = meta(BS)
    runner.model(ids, pos, good, runner.kv_caches)
    assert good.checked  # the layers after the first ran unchecked


def test_block_tables_are_as_wide_as_the_pool_lets_a_request_be(tiny, kv_managers):
    """The checkpoint allows 512 positions; a pool of 8 blocks of 4 caps the
    engine at 32 tokens a request, and the runner's tables (and the decode
    graphs' full-width layouts) follow the cap, not the checkpoint."""
    from kvstrata.config import EngineConfig
    from kvstrata.enginecore.builder import build_engine_core
    from kvstrata.enginecore.request import EngineRequest

    path, hf = tiny
    core = build_engine_core(EngineConfig(model=ModelConfig(model=path), cache=CacheConfig(block_size=BS, num_blocks=9)))
    kv_managers.append(core.kv)
    runner = core.runner
    assert (core.max_model_len, runner.max_model_len, runner.batch.max_blocks) == (32, 32, 8)
    with pytest.raises(RuntimeError, match="before initialize_kv_cache"):
        runner.limit_max_model_len(16)
    prompt = PROMPTS["a"]
    core.add_request(EngineRequest(request_id="a", prompt_token_ids=prompt,
                                   sampling_params=SamplingParams(temperature=0.0, max_tokens=4)))
    got = []
    while core.has_work():
        got += [t for out in core.step() for t in out.new_token_ids]
    assert got == hf_greedy(hf, prompt, 4)


def test_out_of_device_memory_at_start_names_what_to_lower(tiny, monkeypatch):
    """The KV cache is sized from cache.kv_cache_memory_mib; warm-up and the
    decode graphs allocate after it. Out of memory at either (injected here:
    a CPU has no device limit) is an error naming the knobs, not a bare OOM."""
    import kvstrata.worker.model_runner as mr

    runner = ModelRunner(ModelConfig(model=tiny[0]), CacheConfig(block_size=BS))

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    real = mr.allocate_kv_caches
    monkeypatch.setattr(mr, "allocate_kv_caches", oom)
    with pytest.raises(torch.OutOfMemoryError, match=r"allocating the KV cache \(64 blocks\).*"
                                                      r"cache\.kv_cache_memory_mib.*Tried to allocate"):
        runner.initialize_kv_cache(64)
    monkeypatch.setattr(mr, "allocate_kv_caches", real)
    runner.use_cuda_graphs = True  # as on a GPU: the graphs' pool comes after the KV cache
    monkeypatch.setattr(runner, "capture_decode_graphs", oom)
    with pytest.raises(torch.OutOfMemoryError, match=r"capturing decode graphs after the KV cache took.*"
                                                      r"model\.cuda_graph_sizes"):
        runner.initialize_kv_cache(64)
    assert runner.kv_caches is None and runner.kv_cache_backing is None
