"""The model side of CacheBlend in the engine: the offload connector's
worker calls a ``SegmentBlender`` (its ``blender``) with a request's tokens,
segment spans and the segments' stored KV; it returns the KV of every token
(``kvstrata.worker.blend.blend_prefill``) and, for each segment the store
did not have, that segment's KV computed on its own, to be stored.

Runs in the step thread, on the model the runner owns; Llama-family models
(the ones ``LlamaForCausalLM`` runs) only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstrata.worker.blend import SegmentKV, blend_prefill, compute_segment_kv
from kvstrata.worker.model.llama import LlamaForCausalLM


class SegmentBlender:
    """Owns nothing but a reference to the model."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model

    def __call__(self, token_ids: list[int], segments: Sequence[tuple[int, int]],
                 cached: list[torch.Tensor | None], ratio: float) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        segs: list[SegmentKV] = []
        fresh: list[torch.Tensor | None] = []
        for (start, end), kv in zip(segments, cached, strict=True):
            toks = token_ids[start:end]
            if kv is None:
                seg = compute_segment_kv(self.model, toks)
                fresh.append(seg.kv)
            else:
                seg = SegmentKV(tuple(toks), kv)
                fresh.append(None)
            segs.append(seg)
        result = blend_prefill(self.model, token_ids, list(segments), segs, ratio)
        return result.kv, fresh
