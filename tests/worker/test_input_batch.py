"""The persistent step buffers and decode-graph padding of InputBatch.

What a captured CUDA graph relies on is checked here on a CPU: a padded
decode step of size n puts every input the forward reads at the addresses
the graph of size n was captured with, padding rows write no KV and attend
to the null block only, and each step's values are written in place.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.types import CachedRequestData, NewRequestData, SamplingParams
from kvstrata.worker.cuda_graphs import graph_sizes
from kvstrata.worker.input_batch import InputBatch
from kvstrata.worker.step_buffers import StepLayout

BS = 4


def _batch(**kw) -> InputBatch:
    return InputBatch(BS, 64, torch.device("cpu"), **kw)


def _add(batch: InputBatch, req_id: str, prompt: list[int], blocks: list[int], computed: int = 0) -> None:
    batch.add(NewRequestData(req_id=req_id, token_ids=prompt, num_prompt_tokens=len(prompt),
                             sampling_params=SamplingParams(temperature=0.0), block_ids=(blocks,),
                             num_computed_tokens=computed))


def test_default_graph_sizes_are_small_powers_then_every_8_capped_by_max_num_seqs():
    assert graph_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert graph_sizes(256)[-1] == 256 and len(graph_sizes(256)) == 3 + 32
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_sizes(3) == [1, 2, 3]
    assert graph_sizes(4096)[-1] == 512
    assert graph_sizes(10, [8, 1, 64, 8]) == [1, 8]


def test_only_decode_only_steps_within_the_largest_size_are_padded():
    batch = _batch(max_num_seqs=16)
    batch.graph_sizes = [1, 2, 4, 8]
    assert batch.graph_size_for(3, 3) == 4
    assert batch.graph_size_for(8, 8) == 8
    assert batch.graph_size_for(1, 1) == 1
    assert batch.graph_size_for(9, 9) is None  # beyond the largest graph
    assert batch.graph_size_for(5, 3) is None  # a prefill or mixed step
    batch.graph_sizes = []
    assert batch.graph_size_for(2, 2) is None


def _decode_step(batch):
    return batch.prepare({"a": 1, "b": 1, "c": 1})


@pytest.fixture
def three_decoding():
    batch = _batch(max_num_seqs=16, max_num_tokens=64)
    _add(batch, "a", [5, 6, 7, 8, 9], [3, 4], computed=4)  # next: token 9 at position 4
    _add(batch, "b", [1, 2], [7], computed=1)
    _add(batch, "c", list(range(10, 19)), [9, 10, 11], computed=8)
    return batch


def test_a_padded_decode_step_writes_its_rows_then_padding(three_decoding):
    batch = three_decoding
    batch.graph_sizes = [1, 2, 4, 8]
    step = _decode_step(batch)
    assert step.graph_size == 4 and step.num_tokens == 3
    assert step.input_ids.tolist() == [9, 2, 18, 0]
    assert step.positions.tolist() == [4, 1, 8, 0]
    m = step.meta
    assert m.slot_mapping.tolist() == [4 * BS + 0, 7 * BS + 1, 11 * BS + 0, -1]
    assert m.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert m.seq_lens.tolist() == [5, 2, 9, 1]
    assert m.block_tables.shape == (4, batch.max_blocks)  # the graph's width: every block a request may have
    assert m.block_tables[0, :2].tolist() == [3, 4] and m.block_tables[2, :3].tolist() == [9, 10, 11]
    assert m.block_tables[3].tolist() == [0] * batch.max_blocks  # padding: the null block
    assert step.logits_indices.tolist() == step.logits_rows == [0, 1, 2]


def test_an_eager_step_uses_a_table_as_wide_as_its_longest_sequence(three_decoding):
    step = _decode_step(three_decoding)
    assert step.graph_size is None
    assert step.meta.block_tables.shape == (3, 3)
    assert step.input_ids.tolist() == [9, 2, 18]


def test_a_padded_step_reads_from_the_addresses_its_graph_was_captured_with(three_decoding):
    batch = three_decoding
    captured = batch.dummy_inputs([1] * 4, graph=True)
    batch.graph_sizes = [4]
    batch.prepare({"a": 5 - 4, "b": 1})  # another step in between (eager layout: other offsets)
    step = _decode_step(batch)

    def where(s):
        m = s.meta
        return [(t.data_ptr(), tuple(t.shape)) for t in
                (s.input_ids, s.positions, m.slot_mapping, m.block_tables, m.query_start_loc, m.seq_lens)]

    assert where(step) == where(captured)
    assert step.input_ids.tolist() == [9, 2, 18, 0]  # the values are this step's, written in place


def test_consecutive_steps_reuse_one_device_buffer(three_decoding):
    batch = three_decoding
    first = _decode_step(batch)
    ptr = first.input_ids.untyped_storage().data_ptr()
    for req_id, state in batch.requests.items():
        state.token_ids.append(100 + len(req_id))
    batch.update(CachedRequestData(req_ids=["a", "b", "c"], new_block_ids=[None, None, ([12],)],
                                   num_computed_tokens=[5, 2, 9]))
    second = _decode_step(batch)
    assert second.input_ids.untyped_storage().data_ptr() == ptr
    assert second.positions.tolist() == [5, 2, 9]
    assert second.meta.slot_mapping.tolist() == [4 * BS + 1, 7 * BS + 2, 11 * BS + 1]
    assert batch.block_table[batch.requests["c"].row, :4].tolist() == [9, 10, 11, 12]  # appended in place


def test_a_step_beyond_the_sized_limits_grows_the_buffers_and_stops_padding():
    batch = _batch(max_num_seqs=2, max_num_tokens=4)
    batch.graph_sizes = [1, 2]
    _add(batch, "a", list(range(1, 10)), [1, 2, 3])
    step = batch.prepare({"a": 9})
    assert batch.num_buffer_growths == 1 and batch.graph_sizes == []
    assert step.input_ids.tolist() == list(range(1, 10))
    assert step.meta.slot_mapping.tolist() == [1 * BS + i for i in range(4)] + [2 * BS + i for i in range(4)] + [12]


def test_the_layout_puts_what_the_forward_reads_before_the_logits_rows():
    lay = StepLayout(num_tokens=8, num_seqs=8, width=16, num_groups=2, num_logits=3)
    other = StepLayout(num_tokens=8, num_seqs=8, width=16, num_groups=2, num_logits=8)
    assert [lay.ids, lay.positions, lay.qsl, lay.seq_lens, lay.slots(1), lay.table(1)] == \
        [other.ids, other.positions, other.qsl, other.seq_lens, other.slots(1), other.table(1)]
    ends = [lay.positions, lay.qsl, lay.seq_lens, lay.slots(0), lay.slots(1), lay.table(0), lay.table(1), lay.logits]
    assert ends == sorted(ends) and lay.size == lay.logits + 3
    assert np.diff(ends).tolist() == [8, 9, 8, 8, 8, 128, 128]



def test_graph_capture_runs_without_the_collector_and_in_thread_local_mode(three_decoding, monkeypatch):
    """A collection mid-capture could free another engine's graphs (cudaFree)
    and invalidate the capture: the collector runs first and is off until the
    captures end, also when one fails; the mode is thread-local. (A CPU cannot
    capture: torch's graph API is stood in by one that records what it saw.)"""
    import contextlib
    import gc

    from kvstrata.worker import cuda_graphs

    seen: list[tuple[str, bool]] = []

    @contextlib.contextmanager
    def graph(g, pool=None, capture_error_mode="global"):
        seen.append((capture_error_mode, gc.isenabled()))
        yield

    cuda = cuda_graphs.torch.cuda
    for name, fake in (("synchronize", lambda *a: None), ("memory_reserved", lambda *a: 0),
                       ("graph_pool_handle", lambda: None), ("CUDAGraph", object), ("graph", graph)):
        monkeypatch.setattr(cuda, name, fake)
    batch = three_decoding
    calls = []

    def forward(step):
        calls.append(step.graph_size)
        if len(calls) == 5:
            raise RuntimeError("capture invalidated")
        return torch.zeros(step.num_tokens, 4)

    assert gc.isenabled()
    guard = cuda_graphs._NoCollector()  # captures in two threads at once: the last to end turns it on
    guard.__enter__()
    guard.__enter__()
    guard.__exit__(None, None, None)
    assert not gc.isenabled()
    guard.__exit__(None, None, None)
    assert gc.isenabled()
    graphs = cuda_graphs.DecodeGraphs(forward, batch, [1, 2])
    graphs.capture()
    assert seen == [("thread_local", False)] * 2 and gc.isenabled()
    with pytest.raises(RuntimeError, match="capture invalidated"):
        cuda_graphs.DecodeGraphs(forward, batch, [1, 2]).capture()
    assert gc.isenabled()


def test_tokens_in_flight_are_fed_from_each_source_step_on_the_device():
    """Decode inputs still on the device come from the sampled-token tensors
    of the steps that drew them: most from one step, some from an older one
    (rows as sampled there); tokens on the host are written directly."""
    batch = _batch(max_num_seqs=16, max_num_tokens=64)
    for rid, base in (("a", 10), ("b", 20), ("c", 30), ("d", 40)):
        _add(batch, rid, [base, base + 1, base + 2], [1 + base // 10], computed=3)
    newer, older = torch.tensor([7, 101, 102]), torch.tensor([201, 202])
    s = batch.requests
    for rid in "abcd":
        s[rid].num_computed_tokens = 3
    s["a"].flight, s["c"].flight, s["b"].flight = (newer, 2), (newer, 1), (older, 0)
    s["d"].token_ids.append(44)
    s["d"].num_computed_tokens = 3  # its token 44 is on the host
    step = batch.prepare({"a": 1, "b": 1, "c": 1, "d": 1})
    assert step.input_ids.tolist()[:4] == [102, 201, 101, 44]
    assert batch.num_fed_tokens == 3
    assert [st.req_id for st in step.sample_states] == ["a", "b", "c", "d"]


def test_a_step_reuses_the_views_of_its_layout_until_the_buffers_grow():
    batch = _batch(max_num_seqs=4, max_num_tokens=8)
    batch.graph_sizes = [1, 2, 4]
    _add(batch, "a", [1, 2, 3], [1], computed=2)
    _add(batch, "b", [4, 5, 6], [2], computed=2)
    first = batch.prepare({"a": 1, "b": 1})
    batch.requests["a"].token_ids.append(9)
    batch.requests["b"].token_ids.append(8)
    for r in "ab":
        batch.requests[r].num_computed_tokens += 1
    second = batch.prepare({"a": 1, "b": 1})
    assert second.input_ids is first.input_ids and second.meta.block_tables is first.meta.block_tables
    assert second.meta is not first.meta  # per-step plans: a new metadata object around the same views
    assert second.input_ids.tolist()[:2] == [9, 8] and second.positions.tolist()[:2] == [3, 3]
    _add(batch, "long", list(range(1, 12)), [3, 4, 5])
    grown = batch.prepare({"long": 11})  # beyond max_num_tokens: new buffers, new views
    assert batch.num_buffer_growths == 1 and grown.input_ids.tolist() == list(range(1, 12))
    assert grown.input_ids.untyped_storage().data_ptr() != first.input_ids.untyped_storage().data_ptr()


def test_the_batch_counts_the_requests_that_ask_for_logprobs():
    batch = _batch()
    for rid, lp in (("a", None), ("b", 2), ("c", 0)):
        batch.add(NewRequestData(req_id=rid, token_ids=[1, 2], num_prompt_tokens=2,
                                 sampling_params=SamplingParams(temperature=0.0, logprobs=lp), block_ids=([1],),
                                 num_computed_tokens=0))
    assert batch.num_with_logprobs == 2
    batch.add(NewRequestData(req_id="b", token_ids=[1, 2], num_prompt_tokens=2,  # re-added (resumed)
                             sampling_params=SamplingParams(temperature=0.0, logprobs=2), block_ids=([1],),
                             num_computed_tokens=0))
    assert batch.num_with_logprobs == 2
    batch.remove("b")
    batch.remove("c")
    batch.remove("nobody")
    assert batch.num_with_logprobs == 0


def test_a_steady_decode_step_feeds_the_last_samples_in_order():
    """Every input in flight, each request at the row it was sampled in: the
    first n inputs are the source's n tokens (one copy); a reordered batch
    still maps each request to its own row."""
    batch = _batch(max_num_seqs=16, max_num_tokens=64)
    for rid in "abc":
        _add(batch, rid, [1, 2, 3], [1], computed=3)
    source = torch.tensor([70, 71, 72])
    for row, rid in enumerate("abc"):
        batch.requests[rid].flight = (source, row)
    assert batch.prepare({"a": 1, "b": 1, "c": 1}).input_ids.tolist()[:3] == [70, 71, 72]
    assert batch.prepare({"c": 1, "a": 1, "b": 1}).input_ids.tolist()[:3] == [72, 70, 71]
    assert batch.prepare({"b": 1, "c": 1}).input_ids.tolist()[:2] == [71, 72]


def test_the_logits_rows_are_the_hidden_states_themselves_only_when_every_row_samples():
    from kvstrata.worker.model_runner import _logits_rows

    batch = _batch(max_num_seqs=16, max_num_tokens=64)
    _add(batch, "a", [1, 2, 3], [1], computed=2)
    _add(batch, "b", [4, 5, 6, 7], [2])
    hidden = torch.arange(20.0).reshape(5, 4)
    decode = batch.prepare({"a": 1})
    assert _logits_rows(hidden[:1], decode) is not None and _logits_rows(hidden[:1], decode).data_ptr() == \
        hidden.data_ptr()  # no gather
    mixed = batch.prepare({"a": 1, "b": 3})  # b's chunk stops short of its prompt's end: no row for it
    assert mixed.logits_rows == [0] and _logits_rows(hidden[:4], mixed).tolist() == [hidden[0].tolist()]
    full = batch.prepare({"a": 1, "b": 4})
    assert full.logits_rows == [0, 4] and _logits_rows(hidden, full).tolist() == [hidden[0].tolist(),
                                                                                 hidden[4].tolist()]
