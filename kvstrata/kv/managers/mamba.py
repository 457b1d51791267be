"""Mamba (state-space) layers: state blocks instead of per-token KV.

Only the state after the last computed token is needed, so every earlier
position maps to the null block. Two modes (``MambaSpec.mamba_cache_mode``):

* ``none``: one running state per request; nothing is cached or hit.
* ``align``: the state at each block boundary the request reaches stays in
  the block of that position and is cached under that position's hash, so a
  later request with the same prefix resumes from it. Per step a request
  holds at most: the previous state block (source of this step's copy), the
  running state block, and ``num_speculative_blocks`` blocks for drafts::

      blocks: [NULL, NULL, S2(prev), S3(running), D, D]

  The previous state block is freed (still cached) on the next allocation.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.kv.block import KVCacheBlock
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.managers.base import SingleTypeKVCacheManager
from kvstrata.kv.specs import KVCacheSpec, MambaSpec
from kvstrata.kv.types import BlockHash, KVRequest, cdiv


class MambaManager(SingleTypeKVCacheManager):
    """Also owns: the per-request index of the previous state block, the set
    of requests already given state blocks, and the hashes cached during the
    current step (a state cached this step is not yet written by the model,
    so a request hitting it must wait for the next step)."""

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int, enable_caching: bool) -> None:
        super().__init__(spec, pool, group_id, enable_caching)
        assert isinstance(spec, MambaSpec)
        self.align = spec.mamba_cache_mode == "align"
        self.num_spec = spec.num_speculative_blocks
        self._last_state_index: dict[str, int] = {}
        self._allocated: set[str] = set()
        self._cached_this_step: set[BlockHash] = set()

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        pool: BlockPool,
        spec: KVCacheSpec,
        group_id: int,
        alignment: int,
    ) -> list[KVCacheBlock]:
        assert isinstance(spec, MambaSpec)
        if spec.mamba_cache_mode != "align":
            return []
        block_size = spec.block_size
        get = pool.hash_maps[group_id].get_one
        for i in range(min(max_length // block_size, len(block_hashes)) - 1, -1, -1):
            block = get(block_hashes[i])
            if block is not None and (i + 1) * block_size % alignment == 0:
                # Only the last state matters; earlier positions are padding.
                return [pool.null_block] * i + [block]
        return []

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - 1)

    def skipped_indices(self, request_id: str, total_computed_tokens: int) -> list[int]:
        # Draft tokens counted as computed may still be rejected: keep their states.
        total = max(0, total_computed_tokens - self.num_spec)
        indices = super().skipped_indices(request_id, total)
        if self.align:
            # Prefill blocks need not be contiguous: the previous state block may
            # sit after a null, beyond the backwards scan.
            index = self._last_state_index.get(request_id)
            if (
                index is not None
                and index < cdiv(total, self.block_size) - 1
                and index not in indices
                and self.req_to_blocks[request_id][index] is not self.null_block
            ):
                indices.append(index)
        return indices

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        if new_computed_blocks and new_computed_blocks[-1].block_hash in self._cached_this_step:
            return self.pool.num_blocks + 1  # never fits: retry next step
        if not self.align:
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens + self.block_size * self.num_spec,
                new_computed_blocks,
                total_computed_tokens,
                num_tokens_main_model,
            )
        # Lookahead tokens are ignored in align mode: states sit on block boundaries.
        num_required = cdiv(num_tokens_main_model, self.block_size) + self.num_spec
        num_held = len(self.req_to_blocks.get(request_id, ()))
        num_new = num_required - len(new_computed_blocks) - num_held
        if num_new > 0:
            # A running request reuses last step's draft blocks: one new state block.
            num_new = 1 if request_id in self._allocated else 1 + self.num_spec
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return max(num_new, 0) + num_evictable

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[KVCacheBlock]:
        if not self.align:
            return super().allocate_new_blocks(
                request_id, num_tokens + self.block_size * self.num_spec, num_tokens_main_model
            )
        num_required = cdiv(num_tokens_main_model, self.block_size) + self.num_spec
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        prev_len = len(req_blocks)
        if num_required <= prev_len:
            return []
        allocated_before = request_id in self._allocated
        if allocated_before:
            self._last_state_index[request_id] = prev_len - 1 - self.num_spec
        elif prev_len > 0:
            self._last_state_index[request_id] = prev_len - 1  # the prefix-hit state
        state_index = num_required - self.num_spec - 1
        null = self.null_block
        if prev_len < state_index:
            req_blocks.extend([null] * (state_index - prev_len))
        if allocated_before:
            # Move last step's draft blocks forward instead of allocating anew.
            for i in range(prev_len - self.num_spec, prev_len):
                if i >= state_index:
                    break
                req_blocks.append(req_blocks[i])
                req_blocks[i] = null
        num_new = num_required - len(req_blocks)
        if num_new > 0:
            req_blocks.extend(self.pool.get_new_blocks(num_new))
        self._allocated.add(request_id)
        return req_blocks[prev_len:]

    def cache_blocks(self, request: KVRequest, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        if not self.align:
            return
        before = self.num_cached_block.get(request.request_id, 0)
        super().cache_blocks(request, block_hashes, num_tokens)
        after = self.num_cached_block.get(request.request_id, 0)
        for block in self.req_to_blocks[request.request_id][before:after]:
            if not block.is_null:
                self._cached_this_step.add(block.block_hash)  # type: ignore[arg-type]

    def free(self, request_id: str) -> None:
        self._allocated.discard(request_id)
        self._last_state_index.pop(request_id, None)
        super().free(request_id)

    def new_step_starts(self) -> None:
        self._cached_this_step.clear()
