"""Paged attention over the block tables: varlen prefill/extend and decode in one call.

    query            [T, Hq, D]     new tokens of B sequences back to back
    query_start_loc  int [B+1]      cumulative: seq b's tokens are query[qsl[b]:qsl[b+1]]
    seq_lens         int [B]        context length of seq b *including* its new tokens
    block_tables     int [B, M]     physical block of each logical block; padding = 0
    key_cache        [num_blocks, block_size, Hkv, D]   (value_cache alike)

New token j of seq b (q_len_b = qsl[b+1] - qsl[b]) sits at position
``seq_lens[b] - q_len_b + j`` and attends to positions ``p <= pos`` (and
``p > pos - sliding_window`` when a window is set). Hq % Hkv == 0: query head
h reads KV head ``h // (Hq // Hkv)``. Scores, softmax and the weighted sum
run in fp32; the output has the query's dtype.

Block 0 is the null block: it pads tables and replaces blocks that slid out
of the window. Its contents are never trusted: a block is read only when it
holds a position some query may attend to (or pads a batched decode chunk),
and the batched decode path zeroes the K/V rows it gathers for masked
positions, so NaN garbage in the null block cannot leak into the output
(0 * NaN is NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstrata.kernels._checks import (
    INDEX_DTYPES,
    KV_DTYPES,
    KernelArgumentError,
    check_cache_pair,
    check_inner_contiguous,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
)
from kvstrata.kernels.attention_native import AttentionKernels, attention_kernels
from kvstrata.kernels.dispatch import use_triton


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    impl: str = "auto",
    split_decode: bool = False,
    plans: dict | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Attention of the new tokens over their sequences' paged KV. Returns ``out`` ([T, Hq, D]).

    ``plans``: a dict that lives as long as the step's ``block_tables``,
    ``query_start_loc`` and ``seq_lens`` hold (one step's attention
    metadata): the torch reference keeps there what it derives from them
    (the host copies of the lengths, the decode chunks and their gather
    indices and masks), so the model's other layers reuse it instead of
    rebuilding it. Never pass one dict for two different steps.

    ``split_decode``: decode steps (one new token per sequence) on the Triton
    path split each sequence's KV range over several programs and combine
    them (flash-decoding), which fills the GPU at small batches (the engine
    turns it on for CUDA: ``model.split_decode``); the torch reference
    ignores it.

    ``check=False`` skips the argument checks: for a caller whose earlier
    call with the same ``plans`` checked arguments of these very shapes (a
    model's later layers). With checks on, the step's lengths are still
    checked only by its first call (``plans`` empty)."""
    if check:
        _check_args(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window,
                    out, lengths=not plans)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if query.shape[0] == 0:
        return out
    if use_triton(impl, query.device):
        from kvstrata.kernels._triton_attention import paged_attention_triton

        paged_attention_triton(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, float(scale), sliding_window, out,
            split_decode=split_decode,
        )
    else:
        paged_attention_ref(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, float(scale), sliding_window, out,
            plans=plans, native=_native_decode(impl, query, key_cache),
        )
    return out


def _native_decode(impl: str, query: torch.Tensor, key_cache: torch.Tensor) -> AttentionKernels | None:
    """The C decode kernel where impl "auto" runs on the CPU and it takes these shapes (else None: SDPA)."""
    if impl != "auto" or query.device.type != "cpu":
        return None
    kernels = attention_kernels()
    return kernels if kernels is not None and kernels.supports(query, key_cache) else None


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    *,
    plans: dict | None = None,
    native: AttentionKernels | None = None,
) -> torch.Tensor:
    """Torch reference of :func:`paged_attention` (no argument checks).

    Sequences with one new token (decode) run in length-sorted chunks (one
    padded SDPA call per chunk, see ``_decode_plan``), or, given ``native``
    (``attention_native``, which must support these shapes), in one call of
    the C kernel reading the cache where it lies, together with every token
    of the queries of up to NATIVE_MAX_QUERY tokens; longer ones
    (prefill/extend) run one SDPA call each over the blocks they can see.
    No Python work per token. ``plans``: see :func:`paged_attention` (the
    plan depends on the window, the cache's block shape, dtype and device
    and the decode kernel besides the step's tensors: each is a key of its
    own).
    """
    key = (sliding_window, tuple(key_cache.shape[1:]), key_cache.dtype, key_cache.device, native is not None)
    plan = plans.get(key) if plans is not None else None
    if plan is None:
        plan = _Plan(query.device, key_cache, block_tables, query_start_loc, seq_lens, sliding_window, native)
        if plans is not None:
            plans[key] = plan
    qsl, lens = plan.qsl, plan.lens
    if plan.native is not None:
        tables, seqs, rows, lo, hi = plan.native
        native.decode(query, key_cache, value_cache, tables, seqs, rows, lo, hi, scale, out)
    else:
        _decode(plan, query, key_cache, value_cache, scale, out)
    for b in plan.extend:
        q_len = qsl[b + 1] - qsl[b]
        _extend_one(query, key_cache, value_cache, block_tables[b], qsl[b], q_len, lens[b], scale, sliding_window, out)
    return out


def _first_visible(first_pos: int, sliding_window: int | None) -> int:
    """Lowest position the earliest query at ``first_pos`` may attend to."""
    return 0 if sliding_window is None else max(0, first_pos - sliding_window + 1)


def _extend_one(query, key_cache, value_cache, table, q_start, q_len, seq_len, scale, window, out) -> None:
    block_size = key_cache.shape[1]
    first_pos = seq_len - q_len
    lo_block = _first_visible(first_pos, window) // block_size
    hi_block = (seq_len + block_size - 1) // block_size
    blocks = table[lo_block:hi_block].to(device=key_cache.device, dtype=torch.int64)
    kv_start = lo_block * block_size
    k = _gather_tokens(key_cache, blocks, seq_len - kv_start)  # [S, Hkv, D]
    v = _gather_tokens(value_cache, blocks, seq_len - kv_start)
    mask = None
    if window is not None or first_pos > 0:
        q_pos = torch.arange(first_pos, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(kv_start, seq_len, device=query.device).unsqueeze(0)
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
    q = query[q_start : q_start + q_len].float().transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
    k = k.float().transpose(0, 1).unsqueeze(0)
    v = v.float().transpose(0, 1).unsqueeze(0)
    # A whole prompt without a window is plain causal attention (SDPA's
    # top-left alignment is right when q_len == kv_len): no mask to build.
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
    out[q_start : q_start + q_len] = o[0].transpose(0, 1).to(out.dtype)


def _gather_tokens(cache: torch.Tensor, blocks: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` token rows of ``blocks``, as [num_tokens, Hkv, D] (a copy)."""
    return _gather_blocks(cache, blocks).view(-1, *cache.shape[2:])[:num_tokens]


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``cache[blocks]`` as [n, block_size * Hkv * D] (into ``out`` when given).
    index_select over the 2-D block view is far faster than over the 4-D cache
    on CPU, and the view exists for both layouts (each block's rows are
    contiguous)."""
    return torch.index_select(cache.flatten(1), 0, blocks, out=out)


# The native kernel attends each token of a query up to this long on its own
# (its K/V rows read once per token); longer ones (prefill chunks) go to SDPA.
NATIVE_MAX_QUERY = 8

# Decode sequences are gathered and attended in chunks of about this many
# bytes of K (V alike): small enough that the gathered copy is still in cache
# when SDPA reads it (one big padded gather of the whole batch cost fresh
# pages and a second trip through DRAM on every call, and was most of the
# step), large enough that per-call overhead stays small for short sequences.
_DECODE_CHUNK_BYTES = 1 << 20


class _Plan:
    """What one step's metadata tells the torch reference, for every layer:
    the host copies of ``query_start_loc`` / ``seq_lens`` and the decode
    chunks (``_decode_plan``), with the gather buffer they share; or, for
    the native kernel, its int32 arguments (``native``: the table, and per
    query token it takes its table row, query row and visible span); and
    the sequences SDPA attends one by one (``extend``)."""

    __slots__ = ("qsl", "lens", "chunks", "buf", "native", "extend")

    def __init__(self, device, key_cache, block_tables, query_start_loc, seq_lens, window, native) -> None:
        self.qsl = qsl = query_start_loc.tolist()
        self.lens = lens = seq_lens.tolist()
        q_lens = [qsl[b + 1] - qsl[b] for b in range(len(lens))]
        # the native kernel takes every token of a short query (decode, speculative
        # verification) as a decode of its own position; SDPA the rest
        short = NATIVE_MAX_QUERY if native is not None else 1
        self.extend = [b for b, q in enumerate(q_lens) if q > short]
        self.native = None
        decode = []  # the sequences the SDPA decode chunks take: none when the native kernel runs
        if native is None:
            decode = [b for b, q in enumerate(q_lens) if q == 1]
        else:
            spans = [(b, qsl[b] + j, _first_visible(lens[b] - q + j, window), lens[b] - q + j + 1)
                     for b, q in enumerate(q_lens) if 1 <= q <= short for j in range(q)]
            if spans:
                meta = torch.tensor(spans, dtype=torch.int32).t().contiguous()
                self.native = (block_tables.to(torch.int32), *meta)
        self.chunks, rows = _decode_plan(device, key_cache, block_tables, self.qsl, lens, decode, window)
        # One gather buffer for every chunk's K and V (and every layer's):
        # index_select into warm, reused memory is much faster than into a
        # fresh allocation per chunk. Reuse is safe: each chunk's SDPA
        # consumes it before the next gather.
        self.buf = key_cache.new_empty((2, rows, key_cache[0].numel())) if decode else None


class _One:
    """A decode chunk of one sequence: exactly its visible rows, no mask."""

    __slots__ = ("blocks", "start", "n", "row")

    def __init__(self, blocks, start, n, row) -> None:
        self.blocks, self.start, self.n, self.row = blocks, start, n, row


class _Chunk:
    """Several decode sequences in one padded SDPA call: the gathered
    blocks (``table``), the rows to zero and the mask (None when every
    gathered row is visible), the query rows."""

    __slots__ = ("table", "nseq", "num_blocks", "hidden", "mask", "rows")

    def __init__(self, table, nseq, num_blocks, hidden, mask, rows) -> None:
        self.table, self.nseq, self.num_blocks = table, nseq, num_blocks
        self.hidden, self.mask, self.rows = hidden, mask, rows


def _decode_plan(device, key_cache, block_tables, qsl, lens, seqs, window) -> tuple[list, int]:
    """Decode tokens in chunks of sequences of similar visible length (sorted,
    so padding stays small). Each sequence gathers only the blocks holding
    positions it can see; a chunk of one needs no mask at all. Returns the
    chunks and the most blocks one chunk gathers."""
    if not seqs:
        return [], 0
    block_size = key_cache.shape[1]
    block_bytes = key_cache[0].numel() * key_cache.element_size()  # not stride(0): blocks may be strided apart
    spans = []  # (num_blocks, b, lo_block, start within the gathered rows, visible length)
    for b in seqs:
        first = _first_visible(lens[b] - 1, window)
        lo = first // block_size
        spans.append(((lens[b] + block_size - 1) // block_size - lo, b, lo, first - lo * block_size, lens[b] - first))
    spans.sort(reverse=True)
    groups, i = [], 0
    while i < len(spans):
        groups.append(spans[i : i + max(1, _DECODE_CHUNK_BYTES // (spans[i][0] * block_bytes))])
        i += len(groups[-1])
    chunks: list = []
    for g in groups:
        if len(g) == 1:
            num_blocks, b, lo, start, n = g[0]
            blocks = block_tables[b, lo : lo + num_blocks].to(device=key_cache.device, dtype=torch.int64)
            chunks.append(_One(blocks, start, n, qsl[b]))
        else:
            chunks.append(_chunk_plan(device, key_cache, block_tables, qsl, g))
    return chunks, max(len(g) * g[0][0] for g in groups)


def _chunk_plan(device, key_cache, block_tables, qsl, chunk) -> _Chunk:
    """Rows outside each sequence's visible span (padding, the null block,
    unwritten tails, slid-out positions) are masked and, per layer, their
    K/V zeroed, so garbage there cannot turn masked terms into NaN (0 * NaN
    is NaN)."""
    block_size = key_cache.shape[1]
    nseq, num_blocks = len(chunk), chunk[0][0]
    kv_len = num_blocks * block_size
    seq_idx = torch.tensor([c[1] for c in chunk], device=block_tables.device)
    cols = torch.tensor([c[2] for c in chunk], device=block_tables.device).unsqueeze(1)
    cols = (cols + torch.arange(num_blocks, device=block_tables.device)).clamp_(max=block_tables.shape[1] - 1)
    table = block_tables.index_select(0, seq_idx).gather(1, cols).to(device=device, dtype=torch.int64).view(-1)
    hidden = mask = None
    if any(c[3] != 0 or c[4] != kv_len for c in chunk):  # else every gathered row is visible
        span = torch.tensor([[c[3], c[3] + c[4]] for c in chunk], device=device)
        k_pos = torch.arange(kv_len, device=device)
        visible = (k_pos >= span[:, :1]) & (k_pos < span[:, 1:])  # [nseq, kv_len]
        hidden = (~visible).view(-1).nonzero().squeeze(1)
        mask = visible[:, None, None, :]
    rows = torch.tensor([qsl[c[1]] for c in chunk], device=device)
    return _Chunk(table, nseq, num_blocks, hidden, mask, rows)


def _decode(plan: _Plan, query, key_cache, value_cache, scale, out) -> None:
    buf = plan.buf
    for chunk in plan.chunks:
        if type(chunk) is _One:
            _decode_one(query, key_cache, value_cache, chunk, scale, out, buf)
        else:
            _decode_chunk(query, key_cache, value_cache, chunk, scale, out, buf)


def _decode_one(query, key_cache, value_cache, one: _One, scale, out, buf) -> None:
    num_blocks, start, n = one.blocks.shape[0], one.start, one.n
    k = _gather_blocks(key_cache, one.blocks, buf[0, :num_blocks]).view(-1, *key_cache.shape[2:])[start : start + n]
    v = _gather_blocks(value_cache, one.blocks, buf[1, :num_blocks]).view(-1, *value_cache.shape[2:])[start : start + n]
    q = query[one.row].float().unsqueeze(1).unsqueeze(0)  # [1, Hq, 1, D]
    k = k.float().transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
    v = v.float().transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    out[one.row] = o.view(out.shape[1:])


def _decode_chunk(query, key_cache, value_cache, c: _Chunk, scale, out, buf) -> None:
    nseq, kv_len = c.nseq, c.num_blocks * key_cache.shape[1]
    k = _gather_blocks(key_cache, c.table, buf[0, : nseq * c.num_blocks]).view(nseq * kv_len, -1)
    v = _gather_blocks(value_cache, c.table, buf[1, : nseq * c.num_blocks]).view(nseq * kv_len, -1)
    if c.hidden is not None:
        k.index_fill_(0, c.hidden, 0.0)
        v.index_fill_(0, c.hidden, 0.0)
    shape = (nseq, kv_len, *key_cache.shape[2:])
    k = k.view(shape).float().transpose(1, 2)  # [nseq, Hkv, kv_len, D]
    v = v.view(shape).float().transpose(1, 2)
    q = query.index_select(0, c.rows).float().unsqueeze(2)  # [nseq, Hq, 1, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=c.mask, scale=scale, enable_gqa=True)
    out.index_copy_(0, c.rows, o.squeeze(2).to(out.dtype))


def _check_args(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, window, out,
                lengths: bool = True) -> None:
    check_tensor("query", query, 3, KV_DTYPES)
    _, block_size, kv_heads, head_dim = check_cache_pair(key_cache, value_cache)
    check_same_dtype("query", query, key_cache=key_cache)
    num_tokens, q_heads, q_dim = query.shape
    if q_dim != head_dim:
        raise KernelArgumentError(f"query head_dim {q_dim} differs from key_cache head_dim {head_dim}")
    if q_heads % kv_heads != 0:
        raise KernelArgumentError(f"query heads ({q_heads}) must be a multiple of key_cache heads ({kv_heads})")
    check_inner_contiguous("query", query, 2)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES)
    check_tensor("query_start_loc", query_start_loc, 1, INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES)
    num_seqs = seq_lens.shape[0]
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    if block_tables.shape[0] != num_seqs:
        raise KernelArgumentError(f"block_tables must have {num_seqs} rows (one per seq), got {block_tables.shape[0]}")
    if block_tables.stride(1) != 1:
        raise KernelArgumentError(f"block_tables rows must be contiguous, got strides {tuple(block_tables.stride())}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise KernelArgumentError(f"scale must be a positive float, got {scale!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise KernelArgumentError(f"sliding_window must be None or an int >= 1, got {window!r}")
    tensors = dict(query=query, key_cache=key_cache, block_tables=block_tables,
                   query_start_loc=query_start_loc, seq_lens=seq_lens)
    if out is not None:
        check_tensor("out", out, 3, KV_DTYPES)
        check_shape("out", out, tuple(query.shape))
        check_same_dtype("query", query, out=out)
        check_inner_contiguous("out", out, 2)
        tensors["out"] = out
    check_same_device(**tensors)
    if lengths and query.device.type == "cpu":
        _check_lengths(query_start_loc, seq_lens, num_tokens, block_size, block_tables.shape[1])


def _check_lengths(query_start_loc, seq_lens, num_tokens, block_size, max_blocks) -> None:
    """CPU only (free there; on CUDA it would cost a sync): the varlen metadata is consistent."""
    qsl = query_start_loc.tolist()
    if qsl[0] != 0 or qsl[-1] != num_tokens:
        raise KernelArgumentError(f"query_start_loc must start at 0 and end at {num_tokens}, got {qsl[0]}..{qsl[-1]}")
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_len = qsl[b + 1] - qsl[b]
        if q_len < 0:
            raise KernelArgumentError(f"query_start_loc must be non-decreasing, got {qsl[b]} then {qsl[b + 1]}")
        if q_len > seq_len:
            raise KernelArgumentError(f"seq_lens[{b}]={seq_len} is shorter than its {q_len} new tokens")
        if (seq_len + block_size - 1) // block_size > max_blocks:
            raise KernelArgumentError(
                f"seq_lens[{b}]={seq_len} needs more than the {max_blocks} blocks in block_tables"
            )
