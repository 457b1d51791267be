"""The architecture of a Llama-family checkpoint, read from its config.json.

One decoder runs every family; what differs is data, a ``FamilySpec`` per
architecture (``FAMILIES``): Llama (biases per ``attention_bias``, no
windows), Qwen2 (q/k/v biases, no o_proj bias, windows per layer), Qwen3
(per-head RMSNorm on q and k, explicit ``head_dim``, windows per layer),
Mistral (``sliding_window`` on every layer, null: full attention). The
per-layer rule is transformers': ``layer_types`` when config.json lists it,
else layers ``max_window_layers`` and up slide when ``use_sliding_window``.
An architecture or RoPE type not listed here is refused by name.

Both spellings of the RoPE settings are accepted: transformers 4.x writes
``rope_theta`` + ``rope_scaling``; transformers 5.x writes one
``rope_parameters`` dict (``{"rope_type": ..., "rope_theta": ..., ...}``).
They are normalised into ``LlamaArchConfig.rope`` (a ``RopeConfig``).
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import msgspec

from kvstrata.text.tokenizer import eos_ids_in

# A config.json (or what a GGUF's metadata says it would be). Any: its values
# are JSON of any shape, each checked where it is read.
HFConfig: TypeAlias = dict[str, Any]

class FamilySpec(msgspec.Struct, frozen=True, kw_only=True):
    """How one architecture differs from Llama, as data."""

    model_type: str
    qkv_bias: bool | None = None  # None: config.json's attention_bias decides
    o_bias: bool | None = None
    qk_norm: bool = False  # RMSNorm over each head of q and k, before RoPE
    # which layers attend through a sliding window:
    #   "none": none (full attention everywhere);
    #   "all_layers": every layer, config's ``sliding_window`` (null: none);
    #   "per_layer": ``layer_types``, else ``use_sliding_window`` + ``max_window_layers``
    window_rule: Literal["none", "all_layers", "per_layer"] = "none"


FAMILIES = {
    "LlamaForCausalLM": FamilySpec(model_type="llama"),
    "Qwen2ForCausalLM": FamilySpec(model_type="qwen2", qkv_bias=True, o_bias=False, window_rule="per_layer"),
    "Qwen3ForCausalLM": FamilySpec(model_type="qwen3", o_bias=False, qk_norm=True, window_rule="per_layer"),
    "MistralForCausalLM": FamilySpec(model_type="mistral", window_rule="all_layers"),
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded: the message names the
    directory and the file, field or tensor that is wrong."""


class UnsupportedArchitectureError(CheckpointError):
    """config.json names an architecture (or a RoPE variant) we do not run."""


class RopeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """RoPE settings; the llama3 fields are used only when ``rope_type`` is
    "llama3", the yarn ones (and ``original_max_position_embeddings``) when
    it is "yarn"."""

    rope_type: str = "default"
    theta: float = 10000.0
    attention_factor: float | None = None  # yarn: None = from factor (and mscale)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # Per-dimension divisors of the frequencies (head_dim // 2 of them), after
    # rope_type's: a GGUF's rope_freqs tensor, llama.cpp's form of Llama 3's
    # scaling (its converter writes the llama3 ramp as these factors).
    freq_factors: tuple[float, ...] | None = None


class LlamaArchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The shape of the network; what the loader builds and the runner sizes the KV cache by."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str | None = None
    architecture: str = "LlamaForCausalLM"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # per layer: the tokens it attends to (None: all, full attention)
    layer_windows: tuple[int | None, ...] = ()


def parse_arch_config(raw: HFConfig, where: str) -> LlamaArchConfig:
    """Validate a config.json dict; ``where`` (the file path) goes into every error."""
    archs = raw.get("architectures")
    by_type = {f.model_type: a for a, f in FAMILIES.items()}
    if archs is None:
        arch_name = by_type.get(raw.get("model_type"))
        if arch_name is None:
            raise UnsupportedArchitectureError(
                f"{where}: model_type {raw.get('model_type')!r} is not supported "
                f"(supported: {sorted(by_type)}; no 'architectures' field given)"
            )
    else:
        arch_name = next((a for a in archs if a in FAMILIES), None)
        if arch_name is None:
            raise UnsupportedArchitectureError(
                f"{where}: architectures {archs!r} are not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
    family = FAMILIES[arch_name]
    layer_windows = _layer_windows(raw, family, arch_name, where)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitectureError(f"{where}: hidden_act {act!r} is not supported (only 'silu')")
    hidden = _int(raw, "hidden_size", where)
    heads = _int(raw, "num_attention_heads", where)
    kv_heads = _int(raw, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise CheckpointError(
            f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    head_dim = raw.get("head_dim") or hidden // heads
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise CheckpointError(f"{where}: head_dim must be a positive even integer, got {head_dim!r}")
    eos_ids = eos_token_ids(raw, where)
    return LlamaArchConfig(
        vocab_size=_int(raw, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size", where),
        num_hidden_layers=_int(raw, "num_hidden_layers", where),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=_int(raw, "max_position_embeddings", where, default=2048),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_parse_rope(raw, where),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        checkpoint_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        architecture=arch_name,
        qkv_bias=bool(raw.get("attention_bias", False)) if family.qkv_bias is None else family.qkv_bias,
        o_bias=bool(raw.get("attention_bias", False)) if family.o_bias is None else family.o_bias,
        qk_norm=family.qk_norm,
        layer_windows=layer_windows,
    )


def _parse_rope(raw: HFConfig, where: str) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    if scaling:
        params = {**params, **scaling}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        reason = (
            " (its frequencies depend on the running sequence length, which a paged KV cache cannot honour)"
            if rope_type == "dynamic"
            else ""
        )
        raise UnsupportedArchitectureError(
            f"{where}: rope_scaling type {rope_type!r} is not supported{reason}; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedArchitectureError(f"{where}: rope partial_rotary_factor != 1 is not supported")
    fields: dict[str, Any] = {"rope_type": rope_type, "theta": float(theta)}  # Any: RopeConfig's keywords
    if rope_type in ("linear", "llama3"):
        if "factor" not in params:
            raise CheckpointError(f"{where}: rope_scaling type {rope_type!r} needs 'factor'")
        fields["factor"] = float(params["factor"])
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise CheckpointError(f"{where}: rope_scaling type 'llama3' needs {key!r}")
        fields["low_freq_factor"] = float(params["low_freq_factor"])
        fields["high_freq_factor"] = float(params["high_freq_factor"])
        fields["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    if rope_type == "yarn":
        orig = params.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
        if not isinstance(orig, int) or orig < 1:
            raise CheckpointError(f"{where}: rope_scaling type 'yarn' needs 'original_max_position_embeddings'")
        factor = params.get("factor")
        fields["original_max_position_embeddings"] = orig
        fields["factor"] = float(factor) if factor is not None else raw["max_position_embeddings"] / orig
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if params.get(key) is not None:
                fields[key] = float(params[key])
        for key in ("beta_fast", "beta_slow"):
            if params.get(key):
                fields[key] = float(params[key])
        fields["truncate"] = bool(params.get("truncate", True))
    factors = raw.get("rope_freq_factors")  # from a GGUF's rope_freqs tensor (no config.json has it)
    if factors is not None:
        if not isinstance(factors, (list, tuple)) or not all(isinstance(f, float) and f > 0 for f in factors):
            raise CheckpointError(f"{where}: rope_freq_factors must be positive numbers")
        fields["freq_factors"] = tuple(factors)
    return RopeConfig(**fields)


def _int(raw: HFConfig, key: str, where: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise CheckpointError(f"{where}: missing field {key!r}")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"{where}: field {key!r} must be a positive integer, got {value!r}")
    return value


def eos_token_ids(raw: HFConfig, where: str) -> tuple[int, ...]:
    """``eos_token_id`` of a config.json or generation_config.json: an int, a
    list of ints, or absent. Anything else names the file."""
    try:
        return eos_ids_in(raw, where)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def with_generation_eos(arch: LlamaArchConfig, generation_config: HFConfig, where: str) -> LlamaArchConfig:
    """``arch`` stopping also at every EOS id ``generation_config.json`` lists
    (instruct checkpoints often name their end-of-turn token only there)."""
    extra = eos_token_ids(generation_config, where)
    merged = tuple(dict.fromkeys((*arch.eos_token_ids, *extra)))
    return arch if merged == arch.eos_token_ids else msgspec.structs.replace(arch, eos_token_ids=merged)


def _layer_windows(raw: HFConfig, family: FamilySpec, arch_name: str, where: str) -> tuple[int | None, ...]:
    n = raw.get("num_hidden_layers")
    if type(n) is not int or n < 1:
        return ()  # _int reports it
    if family.window_rule == "none":
        return (None,) * n
    if family.window_rule == "all_layers":  # Mistral: one window for every layer
        window = raw.get("sliding_window")
        if window is not None and (type(window) is not int or window < 1):
            raise CheckpointError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
        return (window,) * n
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    types = raw.get("layer_types")
    if types is None:
        lo = raw.get("max_window_layers", 0)
        types = ["sliding_attention" if window is not None and i >= lo else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or not set(types) <= {"full_attention", "sliding_attention"}:
        raise CheckpointError(f"{where}: layer_types must list 'full_attention'/'sliding_attention' for each "
                              f"of the {n} layers, got {types!r}")
    if "sliding_attention" in types and (type(window) is not int or window < 1):
        raise CheckpointError(f"{where}: {arch_name} has sliding layers but no positive sliding_window "
                              f"(use_sliding_window={raw.get('use_sliding_window')!r})")
    return tuple(window if t == "sliding_attention" else None for t in types)
