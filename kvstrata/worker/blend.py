"""CacheBlend: reuse the KV of passages that are not a prefix.

In RAG the same passages come back in different orders, so a prefix cache
misses them. CacheBlend (EuroSys'25; LMCache's ``enable_blending``) stores
each passage's ("segment's") KV computed on its own, from position 0, and
for a request:

1. concatenates the cached segments' KV, re-rotating K to the segment's new
   positions (RoPE is a rotation: R(p + d) = R(d) R(p), see :func:`rerotate`);
2. runs every token through layers ``0 .. select_layer - 1`` and computes
   the fresh K/V of every token at ``select_layer`` (layer 0's input is the
   embedding alone, so its K/V equal the cached ones; layer 1 is the first
   whose input has seen the other segments);
3. picks the ``recompute_ratio`` of cached tokens whose fresh K (or V)
   deviates most from the cached one there (L2 over heads and dims; K at
   the same rotation), and from then on runs only those, the tokens no
   segment covers (prefix, question) and the last token through the
   remaining layers; their fresh K/V overwrite the cached ones, every other
   token keeps its cached (re-rotated) K/V::

       tokens      [ prefix | seg A (cached) | seg B (cached) | question ]
       layers < s    all tokens computed, fresh K/V
       layer s       all K/V computed; top-r of A and B by deviation picked
       layers >= s   prefix, picked and question computed; the rest of A/B
                     keeps its cached K/V (the last token is always computed)

Ratio 0 is plain concatenation, ratio 1 is a full prefill. K is the default
deviation (as LMCache's blender): on SmolLM2 RAG prompts it tracked the
full prefill at least as well as V, better at ratios 0.3-0.5.

Layout: a KV tensor is ``(layers, 2, tokens, kv_heads, head_dim)`` (``[:, 0]``
K, ``[:, 1]`` V), the engine's tier chunk layout; K is always stored rotated
(at 0..n-1 for a :class:`SegmentKV`, at its context positions in a
:class:`BlendResult`), as a paged cache holds it. This module runs the
model's own submodules layer by layer (fp32 or the model's dtype, torch
only; attention is SDPA with an explicit causal mask), so the selected
tokens can leave the batch mid-model; :func:`greedy_decode` continues from a
result through the model's ordinary paged forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstrata.worker.model.attention import AttentionMetadata, LlamaAttention
from kvstrata.worker.model.config import LlamaArchConfig
from kvstrata.worker.model.llama import LlamaForCausalLM
from kvstrata.worker.model.rope import RotaryEmbedding, apply_rotary


@dataclass(frozen=True, slots=True)
class SegmentKV:
    """One segment's KV computed on its own: ``kv`` (layers, 2, tokens,
    kv_heads, head_dim), K rotated at positions 0..tokens-1; ``token_ids``
    the tokens it was computed for (checked against the request's span)."""

    token_ids: tuple[int, ...]
    kv: torch.Tensor

    def __post_init__(self) -> None:
        if self.kv.dim() != 5 or self.kv.shape[1] != 2 or self.kv.shape[2] != len(self.token_ids):
            raise ValueError(f"SegmentKV.kv must be (layers, 2, {len(self.token_ids)}, kv_heads, head_dim) "
                             f"for {len(self.token_ids)} tokens, got {tuple(self.kv.shape)}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class BlendResult:
    """``kv``: (layers, 2, tokens, kv_heads, head_dim) of the whole context, K
    rotated at its positions (ready for a paged cache); ``logits``: fp32
    [vocab] of the last token; ``recomputed``: int64 sorted positions whose
    K/V are fresh from ``select_layer`` on (uncovered + selected + last);
    ``selected``: the cached positions among them picked by deviation."""

    kv: torch.Tensor
    logits: torch.Tensor
    recomputed: torch.Tensor
    selected: torch.Tensor


DEVIATIONS = {"key": 0, "value": 1}  # what the selection compares: index into the (K, V) pair


def rerotate(k: torch.Tensor, delta: int, rope: RotaryEmbedding) -> torch.Tensor:
    """K [..., heads, head_dim] rotated at position p -> rotated at p + ``delta``.

    Applies R(delta) with the unscaled cos/sin: a scaled RoPE (yarn) already
    multiplied K by its attention factor once, and R(d) R(p) = R(p + d).
    The angle is taken in fp64; the result equals computing K at p + delta
    up to fp32 rounding of the angles (which grows with the position).
    """
    angle = rope.inv_freq.to(torch.float64) * float(delta)
    return apply_rotary(k, angle.cos().to(k.dtype), angle.sin().to(k.dtype))


def compute_segment_kv(model: LlamaForCausalLM, token_ids: Sequence[int]) -> SegmentKV:
    """The KV of ``token_ids`` prefilled on their own, from position 0."""
    return SegmentKV(tuple(int(t) for t in token_ids), full_prefill(model, token_ids).kv)


def full_prefill(model: LlamaForCausalLM, token_ids: Sequence[int]) -> BlendResult:
    """A plain prefill through the same code path (no segment: all computed)."""
    return blend_prefill(model, token_ids, [], [], 0.0)


@torch.inference_mode()
def blend_prefill(
    model: LlamaForCausalLM,
    token_ids: Sequence[int],
    segments: Sequence[tuple[int, int]],
    cached: Sequence[SegmentKV],
    recompute_ratio: float,
    select_layer: int = 1,
    deviation: str = "key",
) -> BlendResult:
    """Prefill ``token_ids`` reusing ``cached[i]`` for the span ``segments[i]``
    = [start, end), recomputing ``recompute_ratio`` of the cached tokens
    (rounded to the nearest count) from ``select_layer`` on, those whose
    ``deviation`` ("key" or "value") is largest there; see the module
    docstring. ValueError names any bad argument."""
    cfg = model.config
    n = len(token_ids)
    _check_args(cfg, token_ids, segments, cached, recompute_ratio, select_layer)
    if deviation not in DEVIATIONS:
        raise ValueError(f"deviation must be one of {sorted(DEVIATIONS)}, got {deviation!r}")
    which = DEVIATIONS[deviation]
    dtype = model.dtype
    device = model.model.embed_tokens.weight.device  # the engine's device (CPU in tests, CUDA when served)
    kv = torch.empty(cfg.num_hidden_layers, 2, n, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=device)
    covered = torch.zeros(n, dtype=torch.bool, device=device)
    for (start, end), seg in zip(segments, cached, strict=True):
        seg_kv = seg.kv.to(device=device, dtype=dtype)
        kv[:, 0, start:end] = rerotate(seg_kv[:, 0], start, model.rotary)
        kv[:, 1, start:end] = seg_kv[:, 1]
        covered[start:end] = True
    covered[n - 1] = False  # the last token's logits are the answer: always computed

    positions = torch.arange(n, device=device)
    active = positions  # the positions whose rows x holds; all of them until select_layer
    cos, sin = model.rotary.cos_sin(positions, dtype)
    selected = torch.empty(0, dtype=torch.long, device=device)
    x = model.model.embed_tokens(torch.tensor(token_ids, dtype=torch.long, device=device))
    for i, layer in enumerate(model.model.layers):
        attn: LlamaAttention = layer.self_attn
        q, k, v = _qkv(attn, layer.input_layernorm(x), cos[active], sin[active])
        if i == select_layer and covered.any():
            selected = _most_deviating((k, v)[which], kv[i, which], covered, recompute_ratio)
            keep = ~covered
            keep[selected] = True
            active = keep.nonzero().squeeze(1)
            q, k, v, x = q[active], k[active], v[active], x[active]
        kv[i, 0, active] = k
        kv[i, 1, active] = v
        x = x + attn.o_proj(_attend(attn, q, kv[i, 0], kv[i, 1], active, n))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    logits = model.compute_logits(model.model.norm(x[-1:]))[0]
    return BlendResult(kv, logits, active.clone(), selected)


def _check_args(cfg: LlamaArchConfig, token_ids: Sequence[int], segments: Sequence[tuple[int, int]],
                cached: Sequence[SegmentKV], ratio: float, select_layer: int) -> None:
    n = len(token_ids)
    if n == 0:
        raise ValueError("token_ids must not be empty")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"recompute_ratio must be a number in [0, 1], got {ratio!r}")
    layers = cfg.num_hidden_layers
    # layer 0's K/V depend on the token alone: a deviation there is float noise, not context
    bad_layer = isinstance(select_layer, bool) or not isinstance(select_layer, int) or not 1 <= select_layer < layers
    if segments and bad_layer:  # without segments nothing is selected (a plain prefill, any depth)
        raise ValueError(f"select_layer must be an int in [1, {layers - 1}] for a {layers}-layer model, "
                         f"got {select_layer!r}")
    if len(segments) != len(cached):
        raise ValueError(f"segments has {len(segments)} spans but cached has {len(cached)} SegmentKVs")
    prev_end = 0
    for i, (start, end) in enumerate(segments):
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= n):
            raise ValueError(f"segments[{i}] = {(start, end)} is not a non-empty span in [0, {n}]")
        if start < prev_end:
            raise ValueError(f"segments[{i}] = {(start, end)} overlaps or precedes segments[{i - 1}] "
                             f"(spans must be sorted and disjoint)")
        prev_end = end
    for i, (span, seg) in enumerate(zip(segments, cached, strict=True)):
        start, end = span
        if seg.num_tokens != end - start:
            raise ValueError(f"cached[{i}] holds {seg.num_tokens} tokens but segments[{i}] = {tuple(span)} "
                             f"spans {end - start}")
        want = (layers, 2, end - start, cfg.num_key_value_heads, cfg.head_dim)
        if tuple(seg.kv.shape) != want:
            raise ValueError(f"cached[{i}].kv has shape {tuple(seg.kv.shape)} (layers, 2, tokens, kv_heads, "
                             f"head_dim), the model needs {want}")
        if list(seg.token_ids) != [int(t) for t in token_ids[start:end]]:
            raise ValueError(f"cached[{i}] was computed for other tokens than segments[{i}] = {tuple(span)} holds")


def _qkv(attn: LlamaAttention, h: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``LlamaAttention.forward`` computes before it writes the cache:
    q [T, Hq, D] and k [T, Hkv, D] rotated, v [T, Hkv, D]."""
    t = h.shape[0]
    q, k, v = attn.qkv_proj(h).split((attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
    q = q.view(t, attn.num_heads, attn.head_dim)
    k = k.view(t, attn.num_kv_heads, attn.head_dim)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.reshape(t, attn.num_kv_heads, attn.head_dim)


# Queries per SDPA call in _attend: a masked SDPA may take the math path, whose
# temporaries are fp32 scores of every head for each query over the whole
# context (32 heads x 8k context: 1 MiB a query); blocks keep that bounded.
ATTEND_BLOCK = 256


def _attend(attn: LlamaAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            q_pos: torch.Tensor, ctx: int) -> torch.Tensor:
    """Queries q [T, Hq, D] at sorted positions ``q_pos`` over the context's
    first ``ctx`` rows of k/v [N, Hkv, D] (position = row): causal, sliding
    window if the layer has one. Returns [T, Hq * D]. (``ctx`` from the
    caller, who knows its last query: reading ``q_pos`` would be a host sync
    a layer on a GPU.) ``ATTEND_BLOCK`` queries at a time."""
    keys = torch.arange(ctx, device=q_pos.device)
    k_t, v_t = k[:ctx].transpose(0, 1), v[:ctx].transpose(0, 1)
    outs = []
    for lo in range(0, q.shape[0], ATTEND_BLOCK):
        pos = q_pos[lo:lo + ATTEND_BLOCK]
        mask = keys[None, :] <= pos[:, None]
        if attn.sliding_window is not None:
            mask &= keys[None, :] > pos[:, None] - attn.sliding_window
        outs.append(F.scaled_dot_product_attention(q[lo:lo + ATTEND_BLOCK].transpose(0, 1), k_t, v_t,
                                                   attn_mask=mask, scale=attn.scale, enable_gqa=True))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.transpose(0, 1).reshape(q.shape[0], attn.q_size)


def _most_deviating(fresh: torch.Tensor, cached: torch.Tensor, covered: torch.Tensor,
                    ratio: float) -> torch.Tensor:
    """Sorted positions of the ``round(ratio * covered)`` covered tokens whose
    fresh K or V (rows = positions) is furthest (L2 over heads, dims) from the cached one."""
    pos = covered.nonzero().squeeze(1)
    count = min(len(pos), int(math.floor(ratio * len(pos) + 0.5)))
    if count == 0:
        return torch.empty(0, dtype=torch.long, device=covered.device)
    dev = (fresh[pos].float() - cached[pos].float()).flatten(1).norm(dim=1)
    return pos[dev.topk(count).indices].sort().values


@torch.inference_mode()
def greedy_decode(model: LlamaForCausalLM, prefill: BlendResult, max_new_tokens: int, *,
                  stop_ids: Sequence[int] = (), block_size: int = 16) -> list[int]:
    """Greedy tokens after a prefill: the argmax of ``prefill.logits``, then
    up to ``max_new_tokens - 1`` more from the model's paged forward with
    ``prefill.kv`` written into a fresh paged cache (block 0 left as the null
    block). Stops after a token in ``stop_ids``."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    layers, _, n, kv_heads, head_dim = prefill.kv.shape
    num_blocks = 1 + -(-(n + max_new_tokens) // block_size)
    caches = []
    for layer in range(layers):
        pair = torch.zeros(2, num_blocks * block_size, kv_heads, head_dim, dtype=prefill.kv.dtype)
        pair[:, block_size:block_size + n] = prefill.kv[layer]
        caches.append((pair[0].view(num_blocks, block_size, kv_heads, head_dim),
                       pair[1].view(num_blocks, block_size, kv_heads, head_dim)))
    block_tables = torch.arange(1, num_blocks, dtype=torch.int32)[None, :]
    tokens = [int(prefill.logits.argmax())]
    for pos in range(n, n + max_new_tokens - 1):
        if tokens[-1] in stop_ids:
            break
        meta = AttentionMetadata(slot_mapping=torch.tensor([block_size + pos]), block_tables=block_tables,
                                 query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                                 seq_lens=torch.tensor([pos + 1], dtype=torch.int32))
        hidden = model(torch.tensor([tokens[-1]]), torch.tensor([pos]), meta, caches)
        tokens.append(int(model.compute_logits(hidden)[0].argmax()))
    return tokens
