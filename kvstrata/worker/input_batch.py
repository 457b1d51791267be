"""The model runner's persistent batch: what it remembers about each request
between steps, and how one step's flat inputs are built from it.

The scheduler sends new requests in full and running ones as deltas
(``SchedulerOutput``); this keeps the rest. Block tables live in one numpy
array per KV cache group (a model whose layers differ, e.g. full and
sliding-window attention, has several), a row per request slot, so a step's tables, positions and slot
mappings are a handful of vectorised numpy operations, not work per token:

    row r:  [b7, b2, b9, 0, 0 ...]    block ids of request r, in order
    token at position p of request r  ->  slot = row_r[p // bs] * bs + p % bs
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.worker.model.attention import AttentionMetadata
from kvstrata.worker.sampler import SamplingMetadata
from kvstrata.worker.step_buffers import StepBuffers, StepLayout, StepViews, layout_capacity, step_layout
from kvstrata.types import CachedRequestData, NewRequestData, SamplingParams

_U64 = (1 << 64) - 1


class RequestState:
    """One request as the runner sees it. ``token_ids`` grows with every token
    the runner samples, so a decode step finds its input token here.

    ``flight``: the token a launched step sampled that has not reached the
    host yet (pipelined steps, ``ModelRunner.launch``): the device tensor of
    that step's sampled tokens and this request's row in it. A decode step
    reads its input token from there, on the device."""

    __slots__ = ("req_id", "row", "token_ids", "num_prompt_tokens", "num_computed_tokens", "params",
                 "generator", "num_blocks", "flight")

    def __init__(self, data: NewRequestData, row: int, device: torch.device, num_groups: int = 1) -> None:
        self.req_id = data.req_id
        self.row = row
        self.token_ids = list(data.token_ids)
        self.num_prompt_tokens = data.num_prompt_tokens
        self.num_computed_tokens = data.num_computed_tokens
        self.params: SamplingParams = data.sampling_params
        seeded = self.params.seed is not None and not self.params.greedy
        self.generator = torch.Generator(device) if seeded else None
        self.num_blocks = [0] * num_groups  # per KV cache group
        self.flight: tuple[torch.Tensor, int] | None = None

    @property
    def num_known(self) -> int:
        """Tokens known to the runner: on the host, plus one still in flight."""
        return len(self.token_ids) + (self.flight is not None)


@dataclass(slots=True, frozen=True)
class StepInputs:
    """One step's flattened inputs; ``sample_batch_idx[i]`` is the position in
    the step's request order of the i-th sampled request.

    The tensors are views of the batch's persistent device buffer
    (:class:`StepBuffers`), valid until the next ``prepare``. A decode step
    padded for a captured CUDA graph has ``graph_size`` set: its tensors hold
    ``graph_size`` rows, the first ``num_tokens`` real, the rest padding that
    writes no KV (slot -1) and attends to the null block only."""

    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata | list[AttentionMetadata]  # one, or one per layer (its group's)
    logits_indices: torch.Tensor
    sample_states: list[RequestState]
    sample_batch_idx: list[int]
    # Per sampled request, its draft tokens (speculative decoding; None: one
    # logits row). A request with d drafts has d + 1 rows in logits_indices.
    sample_drafts: list[list[int] | None] | None = None
    num_tokens: int = 0
    graph_size: int | None = None
    logits_rows: list[int] | None = None  # logits_indices on the host (read without a device sync)


class InputBatch:
    """Owns: the state of every request the runner holds, the block-table
    arrays (one row per request slot, rows reused after a request leaves) and
    the step buffers the forward reads."""

    def __init__(self, block_size: int, max_model_len: int, device: torch.device,
                 layer_groups: list[int] | None = None, *, max_num_tokens: int = 2048,
                 max_num_seqs: int = 256) -> None:
        """``layer_groups[i]``: the KV cache group of layer i (None: one group).
        ``max_num_tokens`` / ``max_num_seqs``: the scheduler's step limits
        (the step buffers are sized for them and grow if a step exceeds them)."""
        self.block_size = block_size
        self.device = device
        self.max_blocks = -(-max_model_len // block_size)
        self.layer_groups = layer_groups
        self.num_groups = max(layer_groups) + 1 if layer_groups else 1
        self.block_tables = [np.zeros((16, self.max_blocks), dtype=np.int32) for _ in range(self.num_groups)]
        self.requests: dict[str, RequestState] = {}
        self.num_with_logprobs = 0  # requests held that ask for logprobs
        self._free_rows = list(range(15, -1, -1))
        self.max_num_tokens = max(max_num_tokens, 1)
        self.max_num_seqs = max(max_num_seqs, 1)
        self.buffers = StepBuffers(self._capacity(), device)
        self._views: dict[StepLayout, StepViews] = {}  # of ``buffers``' device buffer
        self._iota = np.arange(self.max_num_tokens + self.max_num_seqs + 2, dtype=np.int64)  # 0, 1, 2, ...
        self.graph_sizes: list[int] = []  # batch sizes a decode step may be padded to (captured graphs)
        self.num_buffer_growths = 0
        self.num_fed_tokens = 0  # input tokens read on the device from a step not yet read back

    def _capacity(self) -> int:
        return layout_capacity(self.max_num_tokens, self.max_num_seqs, self.max_blocks, self.num_groups)

    @property
    def block_table(self) -> np.ndarray:
        """Group 0's table (the only one for most models)."""
        return self.block_tables[0]

    def __len__(self) -> int:
        return len(self.requests)

    def remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)
            if state.params.logprobs is not None:
                self.num_with_logprobs -= 1

    def add(self, data: NewRequestData) -> None:
        self.remove(data.req_id)  # resumed after preemption, or re-sent: start afresh
        if not self._free_rows:
            self._grow()
        state = RequestState(data, self._free_rows.pop(), self.device, self.num_groups)
        self.requests[data.req_id] = state
        if state.params.logprobs is not None:
            self.num_with_logprobs += 1
        self._append_blocks(state, data.block_ids)

    def update(self, cached: CachedRequestData) -> None:
        requests = self.requests
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = requests[req_id]
            state.num_computed_tokens = num_computed
            if new_blocks is not None:
                self._append_blocks(state, new_blocks)

    def holds_any(self, state: RequestState, block_ids) -> bool:
        """Whether any of ``block_ids`` is in the request's block table."""
        wanted = np.fromiter(block_ids, dtype=np.int32)
        return any(bool(np.isin(t[state.row, : n], wanted).any())
                   for t, n in zip(self.block_tables, state.num_blocks))

    def _append_blocks(self, state: RequestState, group_block_ids) -> None:
        """Append each group's new block ids (one list per group)."""
        for g, block_ids in enumerate(group_block_ids):
            n = len(block_ids)
            if not n:
                continue
            start = state.num_blocks[g]
            end = start + n
            if end > self.max_blocks:
                raise ValueError(
                    f"request {state.req_id!r} has {end} blocks, more than max_model_len allows ({self.max_blocks})"
                )
            self.block_tables[g][state.row, start:end] = block_ids
            state.num_blocks[g] = end

    def _grow(self) -> None:
        old = self.block_tables[0].shape[0]
        for g, t in enumerate(self.block_tables):
            table = np.zeros((old * 2, self.max_blocks), dtype=np.int32)
            table[:old] = t
            self.block_tables[g] = table
        self._free_rows.extend(range(old * 2 - 1, old - 1, -1))

    def prepare(self, num_scheduled_tokens: dict[str, int],
                spec_tokens: dict[str, list[int]] | None = None) -> StepInputs:
        """Flat inputs for computing tokens [num_computed, num_computed + n) of each
        scheduled request; a request samples when that reaches its last known token.
        A request with drafts (``spec_tokens``) computes its next token then
        the drafts, and has a logits row after each of them. A decode-only
        step (one token each, no drafts) is padded to the smallest of
        ``graph_sizes`` that holds it, when there is one."""
        requests = self.requests
        rows: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        tokens: list[int] = []
        sample_states: list[RequestState] = []
        sample_idx: list[int] = []
        sample_drafts: list[list[int] | None] | None = [] if spec_tokens else None
        # Input tokens still on the device (a decode step after a launched one), per
        # source step: its sampled tokens, their positions in ``tokens``, their rows there.
        fed: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for b, (req_id, n) in enumerate(num_scheduled_tokens.items()):
            state = requests[req_id]
            start = state.num_computed_tokens
            end = start + n
            ids = state.token_ids
            host = len(ids)
            flight = state.flight
            known = host if flight is None else host + 1  # num_known, inlined (per request per step)
            rows.append(state.row)
            starts.append(start)
            counts.append(n)
            drafts = spec_tokens.get(req_id) if spec_tokens else None
            if drafts:
                assert flight is None, f"{req_id}: drafts follow a step whose tokens were read"
                assert start + 1 == known and n == 1 + len(drafts), f"{req_id}: drafts need a decode step"
                tokens.append(ids[start])
                tokens.extend(drafts)
            else:
                assert end <= known, f"{req_id}: scheduled past its known tokens ({end} > {known})"
                if start == host:  # its input token is still on the device
                    assert n == 1 and flight is not None, f"{req_id}: only a decode step reads a token in flight"
                    source, frow = flight
                    group = fed.get(id(source))
                    if group is None:
                        group = fed[id(source)] = (source, [], [])
                    group[1].append(len(tokens))
                    group[2].append(frow)
                    tokens.append(0)
                elif n == 1:
                    tokens.append(ids[start])
                else:
                    tokens.extend(ids[start:end])
            if drafts or end == known:
                sample_states.append(state)
                sample_idx.append(b)
                if sample_drafts is not None:
                    sample_drafts.append(drafts or None)
        step = self._tensors(list(num_scheduled_tokens), np.array(rows, dtype=np.int64),
                             np.array(starts, dtype=np.int64), np.array(counts, dtype=np.int64), tokens,
                             sample_states, sample_idx, sample_drafts)
        for source, into, from_rows in fed.values():
            self._feed(step.input_ids, source, into, from_rows)
            self.num_fed_tokens += len(into)
        return step

    def _feed(self, input_ids: torch.Tensor, source: torch.Tensor, into: list[int], rows: list[int]) -> None:
        """Write input tokens still in flight into ``input_ids`` (at ``into``) on
        the device, from rows ``rows`` of the sampled-token tensor of the step
        that drew them (queued on the stream after that step: no host sync)."""
        n = len(into)
        if into[0] == 0 and into[-1] == n - 1 and into == rows:  # ``into`` rises: it is 0..n-1
            # steady decode: the first n inputs are the last step's n samples, in order
            input_ids[:n].copy_(source[:n])
            return
        idx = to_device(into + rows, torch.int64, self.device)  # one copy: [positions | rows]
        input_ids.index_copy_(0, idx[:n], source.index_select(0, idx[n:]).to(input_ids.dtype))

    def graph_size_for(self, num_tokens: int, num_seqs: int) -> int | None:
        """The captured batch size a step of ``num_tokens`` tokens over
        ``num_seqs`` sequences replays at: decode-only steps (one token per
        sequence) within the largest captured size; else None (eager)."""
        sizes = self.graph_sizes
        if not sizes or num_tokens != num_seqs or num_seqs > sizes[-1]:
            return None
        return sizes[bisect.bisect_left(sizes, num_seqs)]

    def _tensors(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        tokens: list[int],
        sample_states: list[RequestState],
        sample_idx: list[int],
        sample_drafts: list[list[int] | None] | None = None,
    ) -> StepInputs:
        bs = self.block_size
        num_tokens = len(tokens)
        num_seqs = len(counts)
        seq_lens = starts + counts
        iota = self._iota
        if len(iota) <= num_tokens + self.max_num_seqs + 1:  # a step beyond the sized limits
            iota = self._iota = np.arange(2 * (num_tokens + self.max_num_seqs + 1), dtype=np.int64)
        decode = num_tokens == num_seqs and counts.max() == 1  # one token each: no per-token expansion
        if decode:
            cu = iota[1:num_seqs + 1]
            positions = starts
            token_rows = rows
            logits_idx = np.array(sample_idx, dtype=np.int64)  # cu[i] - 1 == i
        else:
            cu = np.cumsum(counts)
            positions = np.repeat(starts - cu + counts, counts) + iota[:num_tokens]
            token_rows = np.repeat(rows, counts)
            last = cu[sample_idx] - 1
            if sample_drafts is None:
                logits_idx = last
            else:  # a request with d drafts: a row after its token and after each draft
                logits_idx = np.array([i for end, d in zip(last.tolist(), sample_drafts)
                                       for i in range(end - len(d or ()), end + 1)], dtype=np.int64)
        graph_size = self.graph_size_for(num_tokens, num_seqs)
        if graph_size is not None:  # the captured graph's layout: padded rows, full-width tables
            lay = step_layout(graph_size, graph_size, self.max_blocks, self.num_groups, len(logits_idx))
        else:
            width = -(-int(seq_lens.max()) // bs)
            lay = step_layout(num_tokens, num_seqs, width, self.num_groups, len(logits_idx))
        if num_tokens > self.max_num_tokens or num_seqs > self.max_num_seqs or lay.size > self.buffers.capacity:
            self._grow_buffers(num_tokens, num_seqs)
        pad_t, pad_s = lay.num_tokens, lay.num_seqs
        h = self.buffers.begin()
        h[lay.ids:lay.ids + num_tokens] = tokens
        h[lay.positions:lay.positions + num_tokens] = positions
        qsl = h[lay.qsl:lay.qsl + pad_s + 1]
        qsl[0] = 0
        qsl[1:num_seqs + 1] = cu
        h[lay.seq_lens:lay.seq_lens + num_seqs] = seq_lens
        if pad_t > num_tokens:  # a graph's padding rows: token 0 at position 0, no KV written
            h[lay.ids + num_tokens:lay.ids + pad_t] = 0
            h[lay.positions + num_tokens:lay.positions + pad_t] = 0
        if pad_s > num_seqs:  # padding sequences: one token each, a context of 1 (the null block)
            qsl[num_seqs + 1:] = iota[num_tokens + 1:num_tokens + 1 + pad_s - num_seqs]
            h[lay.seq_lens + num_seqs:lay.seq_lens + pad_s] = 1
        block_of, offset = np.divmod(positions, bs)
        for g, table in enumerate(self.block_tables):
            o = lay.slots(g)
            h[o:o + num_tokens] = table[token_rows, block_of] * bs + offset
            if pad_t > num_tokens:
                h[o + num_tokens:o + pad_t] = -1
            t = h[lay.table(g):lay.table(g) + pad_s * lay.width].reshape(pad_s, lay.width)
            t[:num_seqs] = table[rows, :lay.width]
            if pad_s > num_seqs:
                t[num_seqs:] = 0
        h[lay.logits:lay.logits + len(logits_idx)] = logits_idx
        d = self.buffers.commit(lay.size)
        v = self._step_views(d, lay)
        return StepInputs(
            req_ids=req_ids,
            input_ids=v.input_ids,
            positions=v.positions,
            meta=v.metadata(self.layer_groups),
            logits_indices=v.logits_indices,
            sample_states=sample_states,
            sample_batch_idx=sample_idx,
            sample_drafts=sample_drafts,
            num_tokens=num_tokens,
            graph_size=graph_size,
            logits_rows=list(sample_idx) if decode else logits_idx.tolist(),
        )

    def _step_views(self, d: torch.Tensor, lay: StepLayout) -> StepViews:
        """The views of the device buffer ``d`` a step laid out as ``lay`` reads
        (kept per layout: slicing a tensor costs more than looking it up)."""
        views = self._views.get(lay)
        if views is None:
            if len(self._views) >= 512:  # eager shapes vary: keep the recent ones
                self._views.clear()
            views = self._views[lay] = StepViews(d, lay)
        return views

    def _grow_buffers(self, num_tokens: int, num_seqs: int) -> None:
        """A step beyond the limits the buffers were sized for (a runner used
        without its scheduler's limits): larger buffers. Captured graphs read
        the old ones, so they are dropped (``graph_sizes`` emptied; the owner
        sees ``num_buffer_growths`` move and releases them)."""
        self.max_num_tokens = max(self.max_num_tokens, num_tokens)
        self.max_num_seqs = max(self.max_num_seqs, num_seqs)
        self.buffers = StepBuffers(self._capacity(), self.device)
        self._views.clear()  # views of the old buffer
        self.graph_sizes = []
        self.num_buffer_growths += 1

    def dummy_inputs(self, q_lens: list[int], *, graph: bool = False) -> StepInputs:
        """Inputs of a step with no real request: sequence b has ``q_lens[b]``
        new tokens and that many positions of context, all in the null block,
        and no token writes KV (slot -1). For warm-up (every kernel
        specialization compiled before the first request) and, with
        ``graph``, for capturing a decode graph of ``len(q_lens)`` rows: its
        tensors then sit where every later step of that size puts its own."""
        counts = np.asarray(q_lens, dtype=np.int64)
        num_tokens, num_seqs = int(counts.sum()), len(q_lens)
        if graph:
            assert num_tokens == num_seqs, "a decode graph has one token per sequence"
            width = self.max_blocks
        else:
            width = -(-int(counts.max()) // self.block_size)
        lay = step_layout(num_tokens, num_seqs, width, self.num_groups, 0)
        if num_tokens > self.max_num_tokens or num_seqs > self.max_num_seqs or lay.size > self.buffers.capacity:
            raise ValueError(f"a step of {num_tokens} tokens over {num_seqs} sequences exceeds the step buffers")
        h = self.buffers.begin()
        h[:lay.size] = 0
        h[lay.positions:lay.positions + num_tokens] = np.concatenate([np.arange(n) for n in q_lens])
        h[lay.qsl + 1:lay.qsl + num_seqs + 1] = np.cumsum(counts)
        h[lay.seq_lens:lay.seq_lens + num_seqs] = counts
        for g in range(self.num_groups):
            h[lay.slots(g):lay.slots(g) + num_tokens] = -1
        v = self._step_views(self.buffers.commit(lay.size), lay)
        return StepInputs(req_ids=[], input_ids=v.input_ids, positions=v.positions,
                          meta=v.metadata(self.layer_groups), logits_indices=v.logits_indices, sample_states=[],
                          sample_batch_idx=[], num_tokens=num_tokens, graph_size=num_seqs if graph else None,
                          logits_rows=[])


class RowParams:
    """The per-row sampling tensors and flags of one list of sampled requests
    (they change only when the list does), and the rows that need work at
    every step: seeded ones (their generator reseeded for the position) and
    ones under ``min_tokens`` (stop tokens banned)."""

    __slots__ = ("states", "temperature", "all_greedy", "all_random", "top_k", "top_p", "min_p", "seeded",
                 "min_tokens", "num_logprobs")

    def __init__(self, states: list[RequestState], device: torch.device) -> None:
        self.states = states
        params = [s.params for s in states]
        temps = [0.0 if p.greedy else p.temperature for p in params]
        self.temperature = to_device(temps, torch.float32, device)
        self.all_greedy = all(t == 0.0 for t in temps)
        self.all_random = all(t != 0.0 for t in temps)
        self.top_k = self.top_p = self.min_p = None
        if not self.all_greedy:
            if any(p.top_k > 0 for p in params):
                self.top_k = to_device([p.top_k for p in params], torch.int64, device)
            if any(p.top_p < 1.0 for p in params):
                self.top_p = to_device([p.top_p for p in params], torch.float32, device)
            if any(p.min_p > 0.0 for p in params):
                self.min_p = to_device([p.min_p for p in params], torch.float32, device)
        self.seeded = [i for i, s in enumerate(states) if s.generator is not None]
        self.min_tokens = [i for i, p in enumerate(params) if p.min_tokens]
        self.num_logprobs = [p.logprobs for p in params] if any(p.logprobs is not None for p in params) else None

    def metadata(self, eos_token_ids: tuple[int, ...]) -> SamplingMetadata:
        """This step's metadata: the rows' tensors, each seeded row's generator
        reseeded for its position, stop tokens banned for rows under ``min_tokens``."""
        meta = SamplingMetadata(temperature=self.temperature, all_greedy=self.all_greedy,
                                all_random=self.all_random, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                                num_logprobs=self.num_logprobs)
        states = self.states
        for i in self.seeded:
            state = states[i]
            assert state.generator is not None
            state.generator.manual_seed(step_seed(state.params.seed, state.num_known))
            meta.generators[i] = state.generator
        for i in self.min_tokens:
            state = states[i]
            p = state.params
            if state.num_known - state.num_prompt_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) if p.ignore_eos else [*p.stop_token_ids, *eos_token_ids]
                if banned:
                    meta.banned_token_ids[i] = banned
        return meta


def sampling_metadata(
    states: list[RequestState], eos_token_ids: tuple[int, ...], device: torch.device
) -> SamplingMetadata:
    """Per-row sampling parameters for the requests sampled this step."""
    return RowParams(states, device).metadata(eos_token_ids)


class SamplingMetadataCache:
    """Owns: the row params of the last list of sampled requests. A decode
    batch samples the same requests, in the same order, step after step:
    their per-row tensors are built (and copied to the device) once, not
    per step. Holds those requests' states until the list changes."""

    __slots__ = ("_eos", "_device", "_last", "num_builds")

    def __init__(self, eos_token_ids: tuple[int, ...], device: torch.device) -> None:
        self._eos = eos_token_ids
        self._device = device
        self._last: RowParams | None = None
        self.num_builds = 0

    def __call__(self, states: list[RequestState]) -> SamplingMetadata:
        """``sampling_metadata(states, ...)``, the row tensors reused when ``states`` is the last list."""
        last = self._last
        if last is None or len(last.states) != len(states) or not all(map(operator.is_, last.states, states)):
            last = self._last = RowParams(list(states), self._device)
            self.num_builds += 1
        return last.metadata(self._eos)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-step tensor on ``device`` without a host sync: staged in
    pinned memory (torch's caching host allocator reuses the buffer only once
    its copy has run) and copied non-blocking."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def step_seed(seed: int, position: int) -> int:
    """A 64-bit seed for sampling the token at ``position`` of a seeded request
    (splitmix64 of the pair): the draw depends on nothing else."""
    z = ((seed & _U64) + 0x9E3779B97F4A7C15 * (position + 1)) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)
