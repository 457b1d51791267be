"""The Llama model against Hugging Face transformers on the same weights:
logits of one full forward over the paged cache, fp32, tight tolerance."""

from __future__ import annotations

import pytest
import torch
from hf_utils import build_tiny_llama, hf_logits
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvstrata.worker.model import AttentionMetadata, RopeConfig, load_checkpoint
from kvstrata.worker.model.rope import inv_frequencies
from kvstrata.kernels import KVCacheShape, allocate_kv_caches

PROMPT = [256, 17, 3, 99, 140, 255, 8, 8, 8, 61, 200, 4, 77, 13, 250, 1, 2, 3, 5, 8, 13, 21, 34]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def paged_logits(ckpt, prompt: list[int], block_size: int = 4) -> torch.Tensor:
    """Our logits for every position of ``prompt``, its K/V in scattered blocks."""
    arch, model = ckpt.arch, ckpt.model
    n = len(prompt)
    nb = -(-n // block_size)
    shape = KVCacheShape(num_layers=arch.num_hidden_layers, num_blocks=2 * nb + 1, block_size=block_size,
                         num_kv_heads=arch.num_key_value_heads, head_size=arch.head_dim)
    _, kv = allocate_kv_caches(shape, "per_layer", model.dtype, "cpu")
    blocks = torch.arange(2 * nb, 0, -2)  # non-contiguous, descending block ids
    pos = torch.arange(n)
    meta = AttentionMetadata(
        slot_mapping=blocks[pos // block_size] * block_size + pos % block_size,
        block_tables=blocks[None].to(torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
    )
    hidden = model(torch.tensor(prompt), pos, meta, kv)
    return model.compute_logits(hidden)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        {"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 16},
        {"attention_bias": True, "mlp_bias": True, "num_hidden_layers": 3},
    ],
    ids=["base", "tied", "llama3_rope", "linear_rope", "gqa_8to1_head_dim", "biases"],
)
def test_logits_match_hf(tmp_path, overrides):
    hf = build_tiny_llama(tmp_path, **overrides)
    ckpt = load_checkpoint(str(tmp_path))
    torch.testing.assert_close(paged_logits(ckpt, PROMPT), hf_logits(hf, PROMPT), atol=2e-5, rtol=1e-5)


def test_tied_embeddings_share_one_tensor(tmp_path):
    build_tiny_llama(tmp_path, tie_word_embeddings=True)
    model = load_checkpoint(str(tmp_path)).model
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sharded_checkpoint_matches_single_file(tmp_path):
    hf = build_tiny_llama(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    ckpt = load_checkpoint(str(tmp_path / "sharded"))
    torch.testing.assert_close(paged_logits(ckpt, PROMPT), hf_logits(hf, PROMPT), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("save_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint_loads_exactly_into_fp32(tmp_path, save_dtype):
    hf = build_tiny_llama(tmp_path, save_dtype=save_dtype)  # fp32 oracle holding the rounded weights
    ckpt = load_checkpoint(str(tmp_path), dtype="float32")
    assert ckpt.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    torch.testing.assert_close(paged_logits(ckpt, PROMPT), hf_logits(hf, PROMPT), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("save_dtype,name", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_auto_dtype_runs_in_checkpoint_dtype(tmp_path, save_dtype, name):
    hf = build_tiny_llama(tmp_path, save_dtype=save_dtype)
    ckpt = load_checkpoint(str(tmp_path), dtype="auto")
    assert ckpt.dtype == name
    assert ckpt.model.model.embed_tokens.weight.dtype == save_dtype
    ours, ref = paged_logits(ckpt, PROMPT), hf_logits(hf, PROMPT)
    assert ours.dtype == torch.float32
    # Half precision compute: close to the fp32 oracle, and the same argmax almost everywhere.
    assert (ours - ref).abs().max() < 0.25 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {**LLAMA3_ROPE, "rope_theta": 500000.0, "original_max_position_embeddings": 8192},
    ],
)
def test_inv_frequencies_equal_transformers(rope):
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128, rope_parameters=rope)
    if rope["rope_type"] == "default":
        ref = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 128, 2, dtype=torch.float) / 128))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg)
    ours = inv_frequencies(
        RopeConfig(
            rope_type=rope["rope_type"],
            theta=rope["rope_theta"],
            factor=rope.get("factor", 1.0),
            low_freq_factor=rope.get("low_freq_factor", 1.0),
            high_freq_factor=rope.get("high_freq_factor", 4.0),
            original_max_position_embeddings=rope.get("original_max_position_embeddings", 8192),
        ),
        128,
    )
    assert torch.equal(ours, ref)


@pytest.mark.parametrize(
    "yarn",
    [
        {"factor": 4.0, "original_max_position_embeddings": 128},  # Qwen2.5's shape, scaled down
        {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16.0, "beta_slow": 2.0},
        {"factor": 4.0, "original_max_position_embeddings": 128, "truncate": False},
        {"factor": 40.0, "original_max_position_embeddings": 256, "mscale": 1.0, "mscale_all_dim": 0.707},
        {"factor": 2.0, "original_max_position_embeddings": 128, "attention_factor": 1.3},
    ],
    ids=["qwen25", "betas", "no-truncate", "mscale", "attention-factor"],
)
def test_yarn_cos_sin_equal_transformers_rotary_embedding(yarn):
    """Our yarn cos/sin (frequencies and attention factor, read from
    config.json the way the loader reads it) against transformers' own
    rotary embedding on the same config."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
    from transformers import Qwen2Config

    from kvstrata.worker.model.config import parse_arch_config
    from kvstrata.worker.model.rope import RotaryEmbedding

    cfg = Qwen2Config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                      num_hidden_layers=1, vocab_size=64, max_position_embeddings=1024,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **yarn})
    arch = parse_arch_config(cfg.to_dict(), "config.json")
    assert arch.rope.rope_type == "yarn"
    ref = Qwen2RotaryEmbedding(cfg)
    pos = torch.tensor([0, 1, 7, 100, 127, 128, 500, 1023])
    ref_cos, ref_sin = ref(torch.zeros(1, 1, dtype=torch.float32), pos[None])
    ours = RotaryEmbedding(arch.rope, arch.head_dim)
    assert ours.scale == pytest.approx(ref.attention_scaling, rel=0, abs=0)
    torch.testing.assert_close(ours.inv_freq, ref.inv_freq, rtol=1e-6, atol=0)
    cos, sin = ours.cos_sin(pos, torch.float32)
    torch.testing.assert_close(torch.cat((cos, cos), -1)[:, 0], ref_cos[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat((sin, sin), -1)[:, 0], ref_sin[0], rtol=1e-5, atol=1e-6)
