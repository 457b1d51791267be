"""The fused decoder-layer kernels compiled on CUDA: against their torch
references (odd and realistic shapes), without a host sync, and captured in a
CUDA graph then replayed on new data. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from kvstrata.kernels import (
    KV_LAYOUTS,
    KVCacheShape,
    allocate_kv_caches,
    fused_add_rms_norm,
    rotary_and_cache,
    silu_and_mul,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5


def _randn(shape, dtype, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=g, device="cuda") * scale).to(dtype)


def _assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: a few ulp (compiled rsqrt and exp are approximate). fp16/bf16: at
    most one ulp apart, on at most 1% of elements."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    ulp = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=ulp)
    assert (got == want).float().mean().item() >= 0.99, "more than 1% of elements differ from the reference"


def _qkv(tokens, q_heads, kv_heads, head_dim, dtype, seed):
    """Strided views into one fused qkv projection output, as LlamaAttention makes them."""
    qkv = _randn((tokens, (q_heads + 2 * kv_heads) * head_dim), dtype, seed, 2.0)
    q, k, v = qkv.split((q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    return (q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim),
            v.view(tokens, kv_heads, head_dim))


def _cos_sin(tokens, head_dim, dtype, seed):
    """What RotaryEmbedding.cos_sin returns: half-width [T, 1, D/2] in the model dtype."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device="cuda", dtype=torch.float) / head_dim))
    g = torch.Generator(device="cuda").manual_seed(seed)
    positions = torch.randint(0, 8192, (tokens,), device="cuda", generator=g)
    freqs = positions.float()[:, None] * inv_freq
    return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


def _slots(tokens, num_slots, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    slots = torch.randperm(num_slots, device="cuda", generator=g)[:tokens]
    slots[3::7] = -1
    return slots


def _cache_pair(layout, dtype, kv_heads, head_dim, tokens, layer=1):
    blocks = tokens // 16 + 4
    shape = KVCacheShape(num_layers=2, num_blocks=blocks, block_size=16, num_kv_heads=kv_heads, head_size=head_dim)
    backing, caches = allocate_kv_caches(shape, layout, dtype, "cuda")
    backing.normal_()
    return backing, caches[layer], blocks * 16


# ---- against the references ---------------------------------------------------------

NORM_CASES = [(dtype, 7, 200) for dtype in DTYPES] + [(torch.bfloat16, 64, 2048), (torch.bfloat16, 4096, 2048),
                                                        (torch.float16, 33, 4096)]


@pytest.mark.parametrize("dtype,tokens,hidden", NORM_CASES)
def test_compiled_add_rms_norm_matches_reference(dtype, tokens, hidden):
    x = _randn((tokens, hidden + 16), dtype, 1, 3.0)[:, 8 : 8 + hidden]  # strided rows
    res = _randn((tokens, hidden), dtype, 2, 3.0)
    weight = (1.0 + 0.2 * _randn((hidden,), torch.float32, 3)).to(dtype)
    normed, summed = fused_add_rms_norm(x, res, weight, EPS)
    want_normed, want_summed = fused_add_rms_norm(x, res, weight, EPS, impl="torch")
    assert torch.equal(summed, want_summed)
    _assert_near(normed, want_normed)
    normed, same = fused_add_rms_norm(x, None, weight, EPS)
    assert same is x
    _assert_near(normed, fused_add_rms_norm(x, None, weight, EPS, impl="torch")[0])


SILU_CASES = [(dtype, 7, 200) for dtype in DTYPES] + [(torch.bfloat16, 64, 5632), (torch.bfloat16, 4096, 5632),
                                                        (torch.float16, 33, 1000)]


@pytest.mark.parametrize("dtype,tokens,inter", SILU_CASES)
def test_compiled_silu_and_mul_matches_reference(dtype, tokens, inter):
    x = _randn((tokens, 2 * inter), dtype, 4, 4.0)
    _assert_near(silu_and_mul(x), silu_and_mul(x, impl="torch"))


ROPE_CASES = (
    [(dtype, layout, 7, 6, 2, 24) for dtype in DTYPES for layout in KV_LAYOUTS]
    + [(torch.bfloat16, layout, tokens, 32, 4, 64) for layout in KV_LAYOUTS for tokens in (64, 4096)]
    + [(torch.bfloat16, "per_layer", 64, 32, 4, 128), (torch.float16, "cross_layer", 4096, 32, 8, 128),
       (torch.bfloat16, "per_layer", 33, 8, 1, 96)]
)


@pytest.mark.parametrize("dtype,layout,tokens,q_heads,kv_heads,head_dim", ROPE_CASES)
def test_compiled_rotary_and_cache_equals_reference(dtype, layout, tokens, q_heads, kv_heads, head_dim):
    q, k, v = _qkv(tokens, q_heads, kv_heads, head_dim, dtype, 5)
    cos, sin = _cos_sin(tokens, head_dim, dtype, 6)
    backing, (kc, vc), num_slots = _cache_pair(layout, dtype, kv_heads, head_dim, tokens)
    original = backing.clone()
    slots = _slots(tokens, num_slots, 7)
    want_backing = backing.clone()
    want_kc, want_vc = _restride(want_backing, layout)
    want = rotary_and_cache(q, k, v, cos, sin, want_kc, want_vc, slots, impl="torch")
    got = rotary_and_cache(q, k, v, cos, sin, kc, vc, slots)
    assert torch.equal(got, want), "RoPE must round exactly as apply_rotary"
    assert torch.equal(backing, want_backing)
    assert not torch.equal(backing, original)


def _restride(backing, layout, layer=1):
    if layout == "per_layer":
        return backing[layer, 0], backing[layer, 1]
    return backing[:, layer, 0], backing[:, layer, 1]


def test_compiled_rotary_drops_slots_past_the_cache():
    q, k, v = _qkv(3, 4, 2, 64, torch.bfloat16, 8)
    cos, sin = _cos_sin(3, 64, torch.bfloat16, 8)
    backing, (kc, vc), num_slots = _cache_pair("per_layer", torch.bfloat16, 2, 64, 16)
    before = backing.clone()
    rotary_and_cache(q, k, v, cos, sin, kc, vc, torch.tensor([num_slots, num_slots + 5, -1], device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(backing, before)


# ---- CUDA graphs and host syncs -------------------------------------------------------


class _Layer:
    """Static buffers of one decoder layer's fused ops at decode size (TinyLlama-like)."""

    def __init__(self, tokens=64, hidden=2048, inter=5632, q_heads=32, kv_heads=4, head_dim=64,
                 dtype=torch.bfloat16):
        self.x = torch.empty((tokens, hidden), device="cuda", dtype=dtype)
        self.res = torch.empty_like(self.x)
        self.weight = (1.0 + 0.2 * _randn((hidden,), torch.float32, 9)).to(dtype)
        self.gate_up = torch.empty((tokens, 2 * inter), device="cuda", dtype=dtype)
        self.qkv = torch.empty((tokens, (q_heads + 2 * kv_heads) * head_dim), device="cuda", dtype=dtype)
        q, k, v = self.qkv.split((q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
        self.q = q.view(tokens, q_heads, head_dim)
        self.k = k.view(tokens, kv_heads, head_dim)
        self.v = v.view(tokens, kv_heads, head_dim)
        self.cos = torch.empty((tokens, 1, head_dim // 2), device="cuda", dtype=dtype)
        self.sin = torch.empty_like(self.cos)
        self.backing, (self.kc, self.vc), self.num_slots = _cache_pair("cross_layer", dtype, kv_heads, head_dim,
                                                                       tokens)
        self.slots = torch.empty((tokens,), device="cuda", dtype=torch.int64)
        self.normed = torch.empty_like(self.x)
        self.res_out = torch.empty_like(self.x)
        self.act = torch.empty((tokens, inter), device="cuda", dtype=dtype)
        self.q_out = torch.empty_like(self.q)

    def fill(self, seed):
        tokens, head_dim = self.x.shape[0], self.q.shape[2]
        for i, t in enumerate((self.x, self.res, self.gate_up, self.qkv)):
            t.copy_(_randn(t.shape, t.dtype, seed + i, 2.0))
        cos, sin = _cos_sin(tokens, head_dim, self.x.dtype, seed)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self.slots.copy_(_slots(tokens, self.num_slots, seed))

    def step(self):
        fused_add_rms_norm(self.x, self.res, self.weight, EPS, out=self.normed, residual_out=self.res_out)
        silu_and_mul(self.gate_up, out=self.act)
        rotary_and_cache(self.q, self.k, self.v, self.cos, self.sin, self.kc, self.vc, self.slots, q_out=self.q_out)

    def outputs(self):
        return [t.clone() for t in (self.normed, self.res_out, self.act, self.q_out, self.backing)]


def test_fused_kernels_capture_in_a_cuda_graph_and_replay_new_data():
    layer = _Layer()
    layer.fill(10)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles every kernel before capture
        layer.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.step()
    for seed in (20, 30):
        layer.fill(seed)
        layer.backing.zero_()
        graph.replay()
        replayed = layer.outputs()
        layer.backing.zero_()
        layer.step()  # eager on the same inputs
        eager = layer.outputs()
        for a, b in zip(replayed, eager, strict=True):
            assert torch.equal(a, b)
        assert replayed[-1].abs().sum() > 0, "the replay must have written the cache"


def test_fused_kernels_never_sync_the_host():
    layer = _Layer(tokens=16)
    layer.fill(40)

    def calls():
        layer.step()
        fused_add_rms_norm(layer.x, None, layer.weight, EPS)
        silu_and_mul(layer.gate_up)
        rotary_and_cache(layer.q, layer.k, layer.v, layer.cos[:, 0], layer.sin[:, 0], layer.kc, layer.vc,
                         layer.slots)

    calls()  # compile first: the compiler may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_new_token_counts_reuse_the_compiled_kernels():
    """num_tokens is not specialised on: warm-up at one batch size covers the others."""
    from kvstrata.kernels import _triton_fused as k

    for tokens in (5, 16, 1, 48):
        layer = _Layer(tokens=tokens, hidden=256, inter=512, q_heads=4, kv_heads=2)
        layer.fill(tokens)
        layer.step()
        if tokens == 5:
            counts = [_num_compiled(kern) for kern in (k.add_rms_norm_kernel, k.silu_and_mul_kernel,
                                                       k.rotary_and_cache_kernel)]
    torch.cuda.synchronize()
    after = [_num_compiled(kern) for kern in (k.add_rms_norm_kernel, k.silu_and_mul_kernel,
                                              k.rotary_and_cache_kernel)]
    assert after == counts


def _num_compiled(lazy) -> int:
    """Compiled specialisations of a LazyKernel on the current device (triton's cache, read-only)."""
    jit = lazy.for_device(torch.device("cuda"))
    caches = getattr(jit, "device_caches", None)
    if caches is None:
        pytest.skip("this triton keeps no device_caches")
    entry = caches.get(torch.cuda.current_device())
    if entry is None:
        return 0
    return len(entry[0])
