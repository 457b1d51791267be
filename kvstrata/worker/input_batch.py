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

from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.worker.model.attention import AttentionMetadata
from kvstrata.worker.sampler import SamplingMetadata
from kvstrata.types import CachedRequestData, NewRequestData, SamplingParams

_U64 = (1 << 64) - 1


class RequestState:
    """One request as the runner sees it. ``token_ids`` grows with every token
    the runner samples, so a decode step finds its input token here."""

    __slots__ = ("req_id", "row", "token_ids", "num_prompt_tokens", "num_computed_tokens", "params",
                 "generator", "num_blocks")

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


@dataclass(slots=True, frozen=True)
class StepInputs:
    """One step's flattened inputs; ``sample_batch_idx[i]`` is the position in
    the step's request order of the i-th sampled request."""

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


class InputBatch:
    """Owns: the state of every request the runner holds, and the block-table
    array (one row per request slot, rows reused after a request leaves)."""

    def __init__(self, block_size: int, max_model_len: int, device: torch.device,
                 layer_groups: list[int] | None = None) -> None:
        """``layer_groups[i]``: the KV cache group of layer i (None: one group)."""
        self.block_size = block_size
        self.device = device
        self.max_blocks = -(-max_model_len // block_size)
        self.layer_groups = layer_groups
        self.num_groups = max(layer_groups) + 1 if layer_groups else 1
        self.block_tables = [np.zeros((16, self.max_blocks), dtype=np.int32) for _ in range(self.num_groups)]
        self.requests: dict[str, RequestState] = {}
        self._free_rows = list(range(15, -1, -1))

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

    def add(self, data: NewRequestData) -> None:
        self.remove(data.req_id)  # resumed after preemption, or re-sent: start afresh
        if not self._free_rows:
            self._grow()
        state = RequestState(data, self._free_rows.pop(), self.device, self.num_groups)
        self.requests[data.req_id] = state
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
        the drafts, and has a logits row after each of them."""
        requests = self.requests
        num_reqs = len(num_scheduled_tokens)
        rows = np.empty(num_reqs, dtype=np.int64)
        starts = np.empty(num_reqs, dtype=np.int64)
        counts = np.empty(num_reqs, dtype=np.int64)
        tokens: list[int] = []
        sample_states: list[RequestState] = []
        sample_idx: list[int] = []
        sample_drafts: list[list[int] | None] | None = [] if spec_tokens else None
        for b, (req_id, n) in enumerate(num_scheduled_tokens.items()):
            state = requests[req_id]
            start = state.num_computed_tokens
            end = start + n
            known = len(state.token_ids)
            rows[b], starts[b], counts[b] = state.row, start, n
            drafts = spec_tokens.get(req_id) if spec_tokens else None
            if drafts:
                assert start + 1 == known and n == 1 + len(drafts), f"{req_id}: drafts need a decode step"
                tokens.append(state.token_ids[start])
                tokens.extend(drafts)
            else:
                assert end <= known, f"{req_id}: scheduled past its known tokens ({end} > {known})"
                if n == 1:
                    tokens.append(state.token_ids[start])
                else:
                    tokens.extend(state.token_ids[start:end])
            if drafts or end == known:
                sample_states.append(state)
                sample_idx.append(b)
                if sample_drafts is not None:
                    sample_drafts.append(drafts or None)
        return self._tensors(list(num_scheduled_tokens), rows, starts, counts, tokens, sample_states, sample_idx,
                             sample_drafts)

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
        cu = np.cumsum(counts)
        num_tokens = int(cu[-1])
        qsl = np.zeros(len(counts) + 1, dtype=np.int32)
        qsl[1:] = cu
        positions = np.repeat(starts - qsl[:-1], counts) + np.arange(num_tokens)
        token_rows = np.repeat(rows, counts)
        seq_lens = (starts + counts).astype(np.int32)
        max_blocks = -(-int(seq_lens.max()) // bs)
        dev = self.device
        qsl_t, lens_t = torch.from_numpy(qsl).to(dev), torch.from_numpy(seq_lens).to(dev)
        metas = []
        for table in self.block_tables:
            slots = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
            metas.append(AttentionMetadata(
                slot_mapping=torch.from_numpy(slots).to(dev),
                block_tables=torch.from_numpy(table[rows, :max_blocks]).to(dev),
                query_start_loc=qsl_t,
                seq_lens=lens_t,
            ))
        meta: AttentionMetadata | list[AttentionMetadata] = metas[0]
        if self.num_groups > 1:
            assert self.layer_groups is not None
            meta = [metas[g] for g in self.layer_groups]
        last = cu[sample_idx] - 1
        if sample_drafts is None:
            logits_indices = torch.from_numpy(last).to(dev)
        else:  # a request with d drafts: a row after its token and after each draft
            idx = [i for end, d in zip(last.tolist(), sample_drafts) for i in range(end - len(d or ()), end + 1)]
            logits_indices = torch.tensor(idx, dtype=torch.int64, device=dev)
        return StepInputs(
            req_ids=req_ids,
            input_ids=torch.tensor(tokens, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            meta=meta,
            logits_indices=logits_indices,
            sample_states=sample_states,
            sample_batch_idx=sample_idx,
            sample_drafts=sample_drafts,
        )


def sampling_metadata(
    states: list[RequestState], eos_token_ids: tuple[int, ...], device: torch.device
) -> SamplingMetadata:
    """Per-row sampling parameters for the requests sampled this step."""
    params = [s.params for s in states]
    temps = [p.temperature for p in params]
    all_greedy = all(t == 0.0 for t in temps)
    meta = SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32, device=device),
        all_greedy=all_greedy,
        all_random=all(t != 0.0 for t in temps),
    )
    if not all_greedy:
        if any(p.top_k > 0 for p in params):
            meta.top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
        if any(p.top_p < 1.0 for p in params):
            meta.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        if any(p.min_p > 0.0 for p in params):
            meta.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    for i, state in enumerate(states):
        p = params[i]
        if state.generator is not None:
            state.generator.manual_seed(step_seed(p.seed, len(state.token_ids)))
            meta.generators[i] = state.generator
        if p.min_tokens and len(state.token_ids) - state.num_prompt_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) if p.ignore_eos else [*p.stop_token_ids, *eos_token_ids]
            if banned:
                meta.banned_token_ids[i] = banned
    if any(p.logprobs is not None for p in params):
        meta.num_logprobs = [p.logprobs for p in params]
    return meta


def step_seed(seed: int, position: int) -> int:
    """A 64-bit seed for sampling the token at ``position`` of a seeded request
    (splitmix64 of the pair): the draw depends on nothing else."""
    z = ((seed & _U64) + 0x9E3779B97F4A7C15 * (position + 1)) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)
