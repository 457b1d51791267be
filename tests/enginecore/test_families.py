"""Per-family loading rules: what each family's checkpoint must hold (Qwen2's
q/k/v biases, Qwen3's q/k norms), and what is refused by name at start."""

from __future__ import annotations

import json

import pytest
from hf_utils import build_tiny_family
from safetensors.torch import load_file, save_file

from kvstrata.worker.model import CheckpointError, load_checkpoint


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def family_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    build_tiny_family(d, request.param)
    return request.param, d


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_each_family_loads_with_its_own_parts(family_dir):
    family, d = family_dir
    arch = load_checkpoint(str(d)).arch
    assert arch.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    assert (arch.qkv_bias, arch.qk_norm) == ((True, False) if family == "qwen2" else (False, True))
    assert not arch.o_bias


def test_a_missing_family_tensor_is_named(family_dir, tmp_path):
    family, src = family_dir
    d = _copy(src, tmp_path / "ckpt")
    tensors = load_file(str(d / "model.safetensors"))
    gone = "model.layers.0.self_attn.k_proj.bias" if family == "qwen2" else "model.layers.0.self_attn.k_norm.weight"
    del tensors[gone]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing 1 tensor"):
        load_checkpoint(str(d))


def test_sliding_layers_follow_use_sliding_window_and_max_window_layers(family_dir, tmp_path):
    family, src = family_dir
    d = _copy(src, tmp_path / "sw")
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("layer_types", None)  # as transformers 4 wrote it: the rule decides
    cfg.update(use_sliding_window=True, sliding_window=6, max_window_layers=1)
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(str(d)).arch.layer_windows == (None, 6)
    cfg["layer_types"] = ["sliding_attention", "sliding_attention"]  # stated per layer: it wins
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(str(d)).arch.layer_windows == (6, 6)
    cfg["layer_types"] = ["sliding_attention"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="layer_types"):
        load_checkpoint(str(d))


def test_mistral_window_becomes_a_sliding_window_kv_spec_and_null_is_full(tmp_path):
    from kvstrata.kv import FullAttentionSpec, SlidingWindowSpec
    from kvstrata.worker.model_runner import layer_kv_specs

    d = tmp_path / "mistral"
    build_tiny_family(d, "mistral")
    arch = load_checkpoint(str(d)).arch
    assert arch.architecture == "MistralForCausalLM" and arch.layer_windows == (8, 8)
    specs = set(layer_kv_specs(arch, "float32", 4).values())
    assert specs == {SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=16, dtype="float32", sliding_window=8)}
    cfg = json.loads((d / "config.json").read_text())
    cfg["sliding_window"] = None
    (d / "config.json").write_text(json.dumps(cfg))
    arch = load_checkpoint(str(d)).arch
    assert arch.layer_windows == (None, None)
    assert set(layer_kv_specs(arch, "float32", 4).values()) == {
        FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=16, dtype="float32")}
