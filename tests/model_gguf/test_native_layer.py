"""Native layers (``kvstrata/worker/model/native_layer.py``): a packed GGUF's
fused decoder layers on a CPU as direct C calls, after the step's first
layer. They must be bit-equal to the fused forward: hidden states and every
KV cache row, over prefills, decode steps and mixed steps, float32 and
bf16, windowed attention, several packed types, linear layers of several
parts (types mixed as in a Q4_K_M file, dense parts), Qwen2's biases and
Qwen3's q/k norms, dense (Hugging Face) checkpoints of every family; only
the qualifying models get them; the first layer still checks every
argument.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "enginecore"))
from gguf_writing import write_random_gguf, write_tiny_gguf  # noqa: E402
from hf_utils import build_tiny_family  # noqa: E402

from kvstrata.config import CacheConfig, ModelConfig  # noqa: E402
from kvstrata.kernels import KVCacheShape, allocate_kv_caches  # noqa: E402
from kvstrata.kernels.fused_native import fused_kernels  # noqa: E402
from kvstrata.kernels.quant_native import native_kernels  # noqa: E402
from kvstrata.worker.model import load_checkpoint  # noqa: E402
from kvstrata.worker.model.attention import AttentionMetadata  # noqa: E402
from kvstrata.worker.model.native_layer import NativeLayer  # noqa: E402
from kvstrata.worker.model.packed import PackedLinear  # noqa: E402

pytestmark = pytest.mark.skipif(fused_kernels() is None or native_kernels() is None,
                                reason="the native C kernels do not run here")

BS = 4
SPAN = 8  # blocks per sequence


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _load(tmp_path, qtype=Q.Q4_1, dtype="float32", layers=3, **kw):
    path = tmp_path / f"rand-{qtype.name}.gguf"
    write_random_gguf(path, qtype, layers=layers, **kw)  # hidden 256: the K-quants need 256 columns
    ckpt = load_checkpoint(str(path), dtype, "cpu", "packed")
    ckpt.model.use_fused_kernels(True)
    return ckpt


def _caches(ckpt, nseqs: int):
    a = ckpt.arch
    shape = KVCacheShape(num_layers=a.num_hidden_layers, num_blocks=1 + SPAN * nseqs, block_size=BS,
                         num_kv_heads=a.num_key_value_heads, head_size=a.head_dim)
    return allocate_kv_caches(shape, "per_layer", ckpt.model.dtype, "cpu")[1]


def _meta(steps: list[tuple[int, int, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
    """One step's positions and metadata: (sequence, tokens before, new tokens) each;
    sequence s owns blocks 1 + SPAN * s ..."""
    pos, slots, qsl, lens, tables = [], [], [0], [], []
    for s, before, new in steps:
        blocks = [1 + SPAN * s + i for i in range(SPAN)]
        p = list(range(before, before + new))
        pos += p
        slots += [blocks[i // BS] * BS + i % BS for i in p]
        qsl.append(qsl[-1] + new)
        lens.append(before + new)
        tables.append(blocks)
    return torch.tensor(pos), AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32))


# prefills, then a mixed step (a decode, a chunk, a new prefill), then decode steps
STEPS = [[(0, 0, 7), (1, 0, 12)], [(0, 7, 1), (1, 12, 3), (2, 0, 5)], [(0, 8, 1), (1, 15, 1), (2, 5, 1)],
         [(0, 9, 1), (1, 16, 1), (2, 6, 1)], [(2, 7, 1)]]


def _run(ckpt, native: bool, steps=STEPS, seed=0):
    model = ckpt.model
    assert model.use_native_layers(native) is None
    assert all((layer.native is not None) == native for layer in model.model.layers)
    kv = _caches(ckpt, 3)
    gen = torch.Generator().manual_seed(seed)
    hidden = []
    for step in steps:
        pos, meta = _meta(step)
        ids = torch.randint(0, ckpt.arch.vocab_size, (pos.numel(),), generator=gen)
        hidden.append(model(ids, pos, meta, kv))
        assert meta.checked
    return hidden, kv


def _assert_bit_equal(a, b):
    (ha, kva), (hb, kvb) = a, b
    for x, y in zip(ha, hb, strict=True):
        assert torch.equal(x, y)
    for (k1, v1), (k2, v2) in zip(kva, kvb, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q6_K], ids=lambda q: q.name)
def test_native_layers_are_bit_equal_to_the_fused_forward(tmp_path, qtype, dtype):
    ckpt = _load(tmp_path, qtype, dtype)
    _assert_bit_equal(_run(ckpt, True), _run(ckpt, False))


def test_linear_layers_of_several_parts_and_dense_parts(tmp_path):
    # as a Q4_K_M file mixes them: v in Q6_K (a part of its own in qkv), down in Q8_0; up dense (F16)
    types = {}
    for i in range(3):
        types |= {f"blk.{i}.attn_v.weight": Q.Q6_K, f"blk.{i}.ffn_down.weight": Q.Q8_0, f"blk.{i}.ffn_up.weight": Q.F16}
    for dtype in ("float32", "bfloat16"):
        ckpt = _load(tmp_path, Q.Q4_K, dtype, types=types)
        layer = ckpt.model.model.layers[1]
        assert len(layer.self_attn.qkv_proj.parts) == 2
        assert any(isinstance(p, torch.Tensor) for p in layer.mlp.gate_up_proj.parts)  # the dense part
        _assert_bit_equal(_run(ckpt, True), _run(ckpt, False))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen2_biases_and_qwen3_qk_norms(tmp_path, family, dtype):
    hf = build_tiny_family(tmp_path / "src", family, num_hidden_layers=3)
    path = tmp_path / f"{family}.gguf"
    write_tiny_gguf(path, hf, family, Q.Q8_0)
    ckpt = load_checkpoint(str(path), dtype, "cpu", "packed")
    ckpt.model.use_fused_kernels(True)
    attn = ckpt.model.model.layers[1].self_attn
    assert isinstance(attn.qkv_proj, PackedLinear)
    assert (attn.qkv_proj.bias is not None) == (family == "qwen2") and attn.qk_norm == (family == "qwen3")
    _assert_bit_equal(_run(ckpt, True), _run(ckpt, False))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_dense_checkpoints(tmp_path, family, dtype):
    # a Hugging Face checkpoint: our Linear layers, F.linear's own calls into the step's buffers
    build_tiny_family(tmp_path / "src", family, num_hidden_layers=3)
    ckpt = load_checkpoint(str(tmp_path / "src"), dtype, "cpu")
    ckpt.model.use_fused_kernels(True)
    assert not isinstance(ckpt.model.model.layers[1].self_attn.qkv_proj, PackedLinear)
    _assert_bit_equal(_run(ckpt, True), _run(ckpt, False))


def test_windowed_attention_goes_through_native_layers(tmp_path):
    ckpt = _load(tmp_path)
    for layer in ckpt.model.model.layers[1:]:  # windows on the layers that run natively
        layer.self_attn.sliding_window = 5
    on, off = _run(ckpt, True), _run(ckpt, False)
    _assert_bit_equal(on, off)
    for layer in ckpt.model.model.layers[1:]:
        layer.self_attn.sliding_window = None
    assert _run(ckpt, False)[0][-1].sub(off[0][-1]).abs().max() > 0  # the window changed the result


def test_a_layer_that_does_not_qualify_keeps_every_layer_fused(tmp_path):
    ckpt = _load(tmp_path)
    model = ckpt.model
    model.use_fused_kernels(False)
    assert model.use_native_layers(True) == "the fused kernels are off"
    model.use_fused_kernels(True)
    assert model.use_native_layers(True) is None
    model.use_fused_kernels(False)  # turning the fused kernels off drops the native layers
    assert all(layer.native is None for layer in model.model.layers)
    other = load_checkpoint(str(tmp_path / "rand-Q4_1.gguf"), "float32", "cpu", "dequantize").model
    other.use_fused_kernels(True)
    other.model.layers[2].mlp.down_proj = torch.nn.Linear(512, 256)  # not one of ours
    assert other.use_native_layers(True) == ("layer 2: mlp.down_proj is a torch.nn.modules.linear.Linear, "
                                             "not our Linear or PackedLinear")
    assert all(layer.native is None for layer in other.model.layers)
    f16 = _load(tmp_path, dtype="float16").model
    assert "float32 or bfloat16" in f16.use_native_layers(True)
    assert isinstance(NativeLayer.bind(model.model.layers[0]), NativeLayer)


def test_the_first_layer_still_checks_and_nothing_is_written_on_a_bad_slot(tmp_path):
    from kvstrata.kernels import KernelArgumentError

    ckpt = _load(tmp_path)
    model = ckpt.model
    assert model.use_native_layers(True) is None
    kv = _caches(ckpt, 1)
    _, meta = _meta([(0, 0, 2)])
    bad = AttentionMetadata(slot_mapping=torch.tensor([BS, (1 + SPAN) * BS]), block_tables=meta.block_tables,
                            query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens)
    with pytest.raises(KernelArgumentError, match="slot_mapping has slot"):
        model(torch.tensor([3, 4]), torch.tensor([0, 1]), bad, kv)
    assert not bad.checked
    assert all(not k.any() and not v.any() for k, v in kv)


def test_the_model_runner_turns_them_on_with_the_fused_kernels(tmp_path):
    from kvstrata.worker.model_runner import ModelRunner

    _load(tmp_path)
    path = str(tmp_path / "rand-Q4_1.gguf")
    tok = tmp_path / "bytes"  # no tokenizer.json: byte-level
    tok.mkdir()
    runner = ModelRunner(ModelConfig(model=path, tokenizer=str(tok)), CacheConfig(block_size=BS))
    assert runner.native_layers and all(layer.native is not None for layer in runner.model.model.layers)
    dense = ModelRunner(ModelConfig(model=path, tokenizer=str(tok), quantized_weights="dequantize"),
                        CacheConfig(block_size=BS))
    assert dense.native_layers
    runner = ModelRunner(ModelConfig(model=path, tokenizer=str(tok), fused_kernels=False), CacheConfig(block_size=BS))
    assert not runner.native_layers and all(layer.native is None for layer in runner.model.model.layers)
