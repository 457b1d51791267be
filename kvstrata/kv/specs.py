"""KV cache specs: what one group of layers needs from the pool.

Layers with the same spec form a :class:`KVCacheGroupSpec`; one manager per
group allocates that group's blocks. All groups share one pool, so a group
with a different block size simply uses the pool's blocks at its own
granularity (the page size in bytes is the runner's business).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import msgspec

from kvstrata.kv.types import require_non_negative_int, require_positive_int

_DTYPE_BYTES = MappingProxyType(
    {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "int8": 1, "uint8": 1}
)


def _dtype_bytes(dtype: str) -> int:
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPE_BYTES)}; got {dtype!r}") from None


class KVCacheSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every spec: the number of tokens per block."""

    block_size: int

    def __post_init__(self) -> None:
        require_positive_int(f"{type(self).__name__}.block_size", self.block_size)

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError


class AttentionSpec(KVCacheSpec, frozen=True, kw_only=True):
    """Paged K and V for ``num_kv_heads`` heads of ``head_size``."""

    num_kv_heads: int
    head_size: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        require_positive_int(f"{name}.num_kv_heads", self.num_kv_heads)
        require_positive_int(f"{name}.head_size", self.head_size)
        _dtype_bytes(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * _dtype_bytes(self.dtype)


class FullAttentionSpec(AttentionSpec, frozen=True, kw_only=True):
    """Causal attention over the whole context: every block is kept."""


class SlidingWindowSpec(AttentionSpec, frozen=True, kw_only=True):
    """Each token attends to the previous ``sliding_window`` tokens (itself included)."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive_int("SlidingWindowSpec.sliding_window", self.sliding_window)


class ChunkedLocalAttentionSpec(AttentionSpec, frozen=True, kw_only=True):
    """Tokens attend only within their own chunk of ``attention_chunk_size``."""

    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive_int("ChunkedLocalAttentionSpec.attention_chunk_size", self.attention_chunk_size)
        if self.attention_chunk_size % self.block_size:
            raise ValueError(
                "ChunkedLocalAttentionSpec.attention_chunk_size must be a multiple of block_size, "
                f"got {self.attention_chunk_size} and {self.block_size}"
            )


class CrossAttentionSpec(AttentionSpec, frozen=True, kw_only=True):
    """Decoder-to-encoder attention: per-request encoder KV, never shared."""


class SinkFullAttentionSpec(AttentionSpec, frozen=True, kw_only=True):
    """Full attention plus ``sink_len`` learned sink positions whose blocks
    are allocated once at start and shared by every request."""

    sink_len: int

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive_int("SinkFullAttentionSpec.sink_len", self.sink_len)
        if self.sink_len % self.block_size:
            raise ValueError(
                f"SinkFullAttentionSpec.sink_len must be a multiple of block_size, "
                f"got {self.sink_len} and {self.block_size}"
            )


MAMBA_CACHE_MODES = ("none", "align")


class MambaSpec(KVCacheSpec, frozen=True, kw_only=True):
    """Recurrent state blocks. Only the state after the last computed token
    is needed; one block holds one state snapshot covering ``block_size``
    tokens of progress.

    ``mamba_cache_mode``: "none" keeps one running state per request and
    caches nothing; "align" keeps a state at every block boundary the
    request reaches, caches those, and frees the older ones.
    """

    state_bytes: int = 0
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        require_non_negative_int("MambaSpec.state_bytes", self.state_bytes)
        require_non_negative_int("MambaSpec.num_speculative_blocks", self.num_speculative_blocks)
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"MambaSpec.mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, got {self.mamba_cache_mode!r}"
            )

    @property
    def page_size_bytes(self) -> int:
        return self.state_bytes


class KVCacheGroupSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Layers sharing one spec (and so one block table per request)."""

    layer_names: list[str]
    spec: KVCacheSpec

    def __post_init__(self) -> None:
        if not isinstance(self.spec, KVCacheSpec):
            raise TypeError(f"KVCacheGroupSpec.spec must be a KVCacheSpec, got {type(self.spec).__name__}")


class KVCacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The pool size (``num_blocks`` includes the null block 0) and the groups."""

    num_blocks: int
    groups: list[KVCacheGroupSpec]

    def __post_init__(self) -> None:
        require_positive_int("KVCacheConfig.num_blocks", self.num_blocks)
        if self.num_blocks < 2:
            raise ValueError(
                f"KVCacheConfig.num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}"
            )
        if not self.groups:
            raise ValueError("KVCacheConfig.groups must name at least one KV cache group")
        for i, g in enumerate(self.groups):
            if not isinstance(g, KVCacheGroupSpec):
                raise TypeError(f"KVCacheConfig.groups[{i}] must be a KVCacheGroupSpec, got {type(g).__name__}")


def group_layer_specs(layer_specs: "Mapping[str, KVCacheSpec]") -> list[KVCacheGroupSpec]:
    """One group per distinct spec, in order of first appearance, holding
    every layer with that spec (each group gets one block table per request
    and one manager). The engine's builder and the model runner both group
    with this, so a layer's group index means the same on both sides."""
    if not layer_specs:
        raise ValueError("the runner's kv_cache_spec() names no layer")
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"layer {name!r}: a KV spec must be a kvstrata.kv KVCacheSpec, got {type(spec).__name__}")
        by_spec.setdefault(spec, []).append(name)
    return [KVCacheGroupSpec(layer_names=names, spec=spec) for spec, names in by_spec.items()]
