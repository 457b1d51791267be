"""Per-family loading rules: what each family's checkpoint must hold (Qwen2's
q/k/v biases, Qwen3's q/k norms), sharded and half-precision saves, the
format-neutral ``build_model`` entry, and what is refused by name at start
(missing tensor, wrong shape, foreign tensor, unknown architecture or RoPE
type), before any weight is allocated."""

from __future__ import annotations

import json

import pytest
import torch
from hf_utils import build_tiny_family
from safetensors.torch import load_file, save_file

from kvstrata.worker.model import CheckpointError, UnsupportedArchitectureError, build_model, load_checkpoint


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


def _expected_params(hf_model) -> dict[str, torch.Tensor]:
    """HF's weights under our names: q/k/v and gate/up stacked into the fused rows."""
    sd = {k: v.detach() for k, v in hf_model.state_dict().items() if "rotary_emb" not in k}
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        for pieces, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            if f".{pieces[0]}." in key:
                out[key.replace(pieces[0], fused)] = torch.cat([sd[key.replace(pieces[0], p)] for p in pieces])
                break
        else:
            if not any(f".{p}." in key for p in ("k_proj", "v_proj", "up_proj")):
                out[key] = value
    return out


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_a_sharded_bf16_family_checkpoint_loads_every_weight_as_saved(family, tmp_path):
    hf = build_tiny_family(tmp_path, family, save_dtype=torch.bfloat16, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    ckpt = load_checkpoint(str(tmp_path), "float32")
    ours = dict(ckpt.model.named_parameters())
    expected = _expected_params(hf)
    if ckpt.arch.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert sorted(ours) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(ours[name], value), name


def test_build_model_takes_a_config_dict_and_named_tensors(family_dir):
    """The format-neutral entry (what a GGUF reader feeds): same model as the directory load."""
    _, d = family_dir
    raw = json.loads((d / "config.json").read_text())
    tensors = load_file(str(d / "model.safetensors"))
    model, arch = build_model(raw, reversed(list(tensors.items())), source="test-tensors")
    ref = load_checkpoint(str(d)).model
    assert arch.architecture == raw["architectures"][0]
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    del tensors["model.norm.weight"]
    with pytest.raises(CheckpointError, match=r"'test-tensors' is missing 1 tensor.*model\.norm\.weight"):
        build_model(raw, tensors.items(), source="test-tensors")


def test_a_wrong_family_tensor_shape_is_named(family_dir, tmp_path):
    family, src = family_dir
    d = _copy(src, tmp_path / "ckpt")
    tensors = load_file(str(d / "model.safetensors"))
    key = "model.layers.1.self_attn.v_proj.bias" if family == "qwen2" else "model.layers.1.self_attn.q_norm.weight"
    tensors[key] = torch.cat([tensors[key], tensors[key][:1]])
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"'{key}'.*has shape \(\d+,\), expected"):
        load_checkpoint(str(d))


def test_a_tensor_another_family_has_is_refused_naming_the_architecture(tmp_path):
    """Qwen3 has no q/k/v biases: a checkpoint carrying one is not a Qwen3."""
    d = tmp_path / "qwen3"
    build_tiny_family(d, "qwen3")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(4 * 24)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.q_proj.bias'.*Qwen3ForCausalLM.*does not use"):
        load_checkpoint(str(d))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"architectures": ["Gemma2ForCausalLM"]}, r"architectures \['Gemma2ForCausalLM'\] are not supported"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0}},
         "rope_scaling type 'longrope' is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
         "rope_scaling type 'dynamic' is not supported"),
    ],
    ids=["architecture", "longrope", "dynamic"],
)
def test_unknown_architecture_or_rope_type_is_named(family_dir, tmp_path, edit, message):
    _, src = family_dir
    d = _copy(src, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(edit)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match=message):
        load_checkpoint(str(d))


def test_a_bad_checkpoint_is_refused_before_any_weight_is_allocated(family_dir, tmp_path):
    """config.json says the embedding has 2**40 rows (a 128 TiB tensor) but the
    file holds the tiny one: the header check names the tensor; building the
    model first would have died in the allocator instead."""
    _, src = family_dir
    d = _copy(src, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 2**40
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"'(model.embed_tokens|lm_head).weight'.*has shape \(320, 64\), expected \(1099511627776, 64\)"):
        load_checkpoint(str(d))
