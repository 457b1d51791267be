"""GGUF files written in the test (gguf.GGUFWriter, the way llama.cpp's
converter lays a Llama out: q/k rows permuted, norms in F32) in several
quantization types: every weight kvstrata loads equals the quantized
round trip of the original, the q/k permutation undone."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "enginecore"))
from gguf_writing import loaded_weights, write_tiny_gguf  # noqa: E402
from hf_utils import build_tiny_llama  # noqa: E402

from kvstrata.worker.model import CheckpointError, load_checkpoint  # noqa: E402

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-src"))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_every_weight_is_the_quantized_original(tiny, tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    expect = write_tiny_gguf(path, tiny, "llama", qtype)
    ckpt = load_checkpoint(str(path), quantized_weights="dequantize")  # the exact path, tensor by tensor
    got = loaded_weights(ckpt)
    assert set(got) == set(expect)
    for name, want in expect.items():
        assert np.array_equal(got[name], want.astype(np.float32)), name
    # and close to the original (the permutation really was undone)
    q = got["model.layers.0.self_attn.q_proj.weight"]
    orig = tiny.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert np.abs(q - orig).max() <= (1e-6 if qtype == Q.F32 else 0.25 * np.abs(orig).max())


def test_an_unknown_gguf_tensor_is_refused_by_name(tiny, tmp_path):
    path = tmp_path / "extra.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(320)
    w.add_tensor("blk.0.attn_mystery.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="attn_mystery"):
        load_checkpoint(str(path))


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K],
                         ids=lambda q: q.name)
def test_dequantized_bytes_equal_gguf_quants(tmp_path, qtype):
    """Random bytes (any scale, NaN and infinity included) read back as
    gguf.quants reads them, bit for bit: the whole-tensor numpy paths
    (in place) and the types left to gguf.quants (the K-quants) alike."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    from kvstrata.worker.model.gguf_file import GGUFCheckpoint

    block, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = 6, 512
    raw = np.random.default_rng(int(qtype)).integers(0, 256, size=(rows, cols // block * type_size), dtype=np.uint8)
    path = tmp_path / f"raw-{qtype.name}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_embedding_length, cols), (w.add_feed_forward_length, 64),
                       (w.add_head_count, 4), (w.add_layer_norm_rms_eps, 1e-6)):
        add(value)
    w.add_tensor("token_embd.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with np.errstate(all="ignore"):  # NaN and infinite scales
        got = dict(GGUFCheckpoint(path).tensors())["model.embed_tokens.weight"]
        want = dequantize(raw, qtype).reshape(rows, cols)
    assert got.shape == (rows, cols)
    assert np.array_equal(got.numpy().view(np.uint32), want.astype(np.float32).view(np.uint32))  # bit for bit
