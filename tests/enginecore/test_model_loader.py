"""Checkpoint loading: clear errors for broken directories, the fingerprint,
and the default random model cached on disk."""

from __future__ import annotations

import json

import pytest
import torch
from hf_utils import build_tiny_llama
from safetensors.torch import load_file, save_file

from kvstrata.worker.model import (
    CheckpointError,
    UnsupportedArchitectureError,
    default_model_dir,
    load_checkpoint,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    build_tiny_llama(d)
    return d


def _copy_checkpoint(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(directory, **changes):
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_checkpoint(str(tmp_path / "nope"))


def test_missing_config_json(tmp_path, tiny_dir):
    d = _copy_checkpoint(tiny_dir, tmp_path / "c")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_checkpoint(str(d))


def test_missing_weights(tmp_path, tiny_dir):
    d = _copy_checkpoint(tiny_dir, tmp_path / "c")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_checkpoint(str(d))


def test_missing_shard(tmp_path):
    build_tiny_llama(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard '{shard.name}'.*is missing"):
        load_checkpoint(str(tmp_path))


def test_missing_tensor_is_named(tmp_path, tiny_dir):
    d = _copy_checkpoint(tiny_dir, tmp_path / "c")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\).*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_checkpoint(str(d))


def test_unexpected_tensor_is_refused(tmp_path, tiny_dir):
    d = _copy_checkpoint(tiny_dir, tmp_path / "c")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.q_proj.bias'.*does not use"):
        load_checkpoint(str(d))


def test_shape_mismatch_is_named(tmp_path, tiny_dir):
    d = _copy_checkpoint(tiny_dir, tmp_path / "c")
    _edit_config(d, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.down_proj.weight'.*shape \(64, 128\), expected \(64, 96\)"):
        load_checkpoint(str(d))


def test_unsupported_architecture(tmp_path, tiny_dir):
    d = _copy_checkpoint(tiny_dir, tmp_path / "c")
    _edit_config(d, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedArchitectureError, match=r"architectures \['GPT2LMHeadModel'\] are not supported"):
        load_checkpoint(str(d))


def test_dynamic_rope_is_refused(tmp_path, tiny_dir):
    d = _copy_checkpoint(tiny_dir, tmp_path / "c")
    _edit_config(d, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedArchitectureError, match="rope_scaling type 'dynamic' is not supported"):
        load_checkpoint(str(d))


def test_missing_config_field_is_named(tmp_path, tiny_dir):
    d = _copy_checkpoint(tiny_dir, tmp_path / "c")
    _edit_config(d, hidden_size=None)
    with pytest.raises(CheckpointError, match="missing field 'hidden_size'"):
        load_checkpoint(str(d))


def test_transformers_v4_rope_spelling_is_read(tmp_path, tiny_dir):
    d = _copy_checkpoint(tiny_dir, tmp_path / "c")
    _edit_config(d, rope_parameters=None, rope_theta=5000.0,
                 rope_scaling={"type": "linear", "factor": 2.0})
    rope = load_checkpoint(str(d)).arch.rope
    assert (rope.rope_type, rope.theta, rope.factor) == ("linear", 5000.0, 2.0)


def test_bad_dtype_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="model.dtype must be"):
        load_checkpoint(str(tiny_dir), dtype="int8")


def test_fingerprint_is_stable_and_tracks_weights_and_dtype(tmp_path, tiny_dir):
    first = load_checkpoint(str(tiny_dir)).fingerprint
    assert load_checkpoint(str(tiny_dir)).fingerprint == first
    assert len(first) == 64
    assert load_checkpoint(str(tiny_dir), dtype="bfloat16").fingerprint != first
    d = _copy_checkpoint(tiny_dir, tmp_path / "c")
    assert load_checkpoint(str(d)).fingerprint == first  # the path is not part of it
    tensors = load_file(d / "model.safetensors")
    tensors["model.embed_tokens.weight"][0, 0] += 1.0
    save_file(tensors, d / "model.safetensors")
    assert load_checkpoint(str(d)).fingerprint != first


def test_default_model_is_built_once_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path))
    small = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "vocab_size": 258, "max_position_embeddings": 128, "bos_token_id": 256, "eos_token_id": 257,
    }
    path = default_model_dir(seed=3, config=small)
    assert path.parent == tmp_path and path.name.endswith("-seed3")
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir(seed=3, config=small) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind
    a = load_checkpoint(str(path))
    b = load_checkpoint(str(default_model_dir(seed=4, config=small)))
    assert a.arch.hidden_size == 32 and a.fingerprint != b.fingerprint
    w = a.model.model.layers[0].self_attn.qkv_proj.weight
    assert 0.015 < float(w.std()) < 0.025
    assert torch.equal(a.model.model.norm.weight, torch.ones(32))
