"""The composition root: the one place an engine core is assembled.

Tests, tools, ``AsyncEngine.start`` and the engine process all build here::

    build_engine_core(config, runner=None, connector=None) -> EngineCore
      runner          build_runner(config) unless given (loads the model)
      layer specs     runner.kv_cache_spec(): {layer name: kv spec}
      groups          kv_cache_groups(specs): equal specs -> one KVCacheGroupSpec
      num_blocks      cache.num_blocks, or kv_cache_memory_mib / bytes per block
      max_model_len   the runner's, capped so one request fits in the pool
      identity        CacheIdentity(model, dtype, layout, block size, ...) + block hasher
      scheduler       build_scheduler -> build_kv_cache_manager (coordinator and
                      managers follow the groups: unitary or hybrid; full, sliding
                      window, chunked local, mamba, cross, sink)
      connector       its scheduler side to the scheduler, its worker side to the runner

``build_scheduler`` and ``build_kv_cache_manager`` are the smaller pieces,
for tests and tools that need only part of an engine. Every check and
derivation is a small function of its own, with its reason.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import structlog

from kvstrata.config import CacheConfig, EngineConfig, SchedulerConfig
from kvstrata.connector import ConnectorSpec, KVConnector, KVConnectorScheduler
from kvstrata.enginecore.engine_core import EngineCore, ModelRunnerLike
from kvstrata.enginecore.scheduler import Scheduler
from kvstrata.kv.specs import group_layer_specs
from kvstrata.kv import (
    AttentionSpec,
    BlockHasher,
    CacheIdentity,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheSpec,
    SinkFullAttentionSpec,
    make_block_hasher,
)

log = structlog.get_logger(__name__)

LayerSpecs = Mapping[str, KVCacheSpec]


# -- the model's KV ---------------------------------------------------------------

def kv_cache_groups(layer_specs: LayerSpecs) -> list[KVCacheGroupSpec]:
    """``kvstrata.kv.specs.group_layer_specs``: equal specs -> one group."""
    return group_layer_specs(layer_specs)


def kv_bytes_per_block(layer_specs: LayerSpecs) -> int:
    """Device bytes behind one block id: a page in every layer."""
    return sum(spec.page_size_bytes for spec in layer_specs.values())


def num_blocks_for_memory(layer_specs: LayerSpecs, mib: int) -> int:
    """How many blocks fit in ``mib`` MiB."""
    return (mib * 1024 * 1024) // kv_bytes_per_block(layer_specs)


def resolve_num_blocks(cache: CacheConfig, layer_specs: LayerSpecs) -> int:
    """``cache.num_blocks``, else as many as ``cache.kv_cache_memory_mib`` holds."""
    num_blocks = cache.num_blocks or num_blocks_for_memory(layer_specs, cache.kv_cache_memory_mib)
    if num_blocks < 2:
        raise ValueError(
            f"cache.kv_cache_memory_mib={cache.kv_cache_memory_mib} holds {num_blocks} blocks; need >= 2"
        )
    return num_blocks


def check_block_size(cache: CacheConfig, groups: list[KVCacheGroupSpec]) -> None:
    """Requests hash at ``cache.block_size``: it must be the smallest block
    size of the model's groups (the others, multiples of it, read the
    hashes at their own granularity)."""
    smallest = min(g.spec.block_size for g in groups)
    if smallest != cache.block_size:
        raise ValueError(f"cache.block_size ({cache.block_size}) differs from the runner's ({smallest})")


def check_prefix_caching(cache: CacheConfig, groups: list[KVCacheGroupSpec]) -> None:
    """Cross-attention KV depends on the encoder input, never on the prefix."""
    if cache.enable_prefix_caching and any(isinstance(g.spec, CrossAttentionSpec) for g in groups):
        raise ValueError("cache.enable_prefix_caching must be false for a model with cross-attention layers")


def pool_token_capacity(groups: list[KVCacheGroupSpec], num_blocks: int) -> int:
    """Tokens one request can surely hold: the usable blocks (not the null
    block, not the sink blocks reserved at start) shared by every group, at
    the smallest block size (a group with bigger blocks needs fewer)."""
    usable = num_blocks - 1
    for g in groups:
        if isinstance(g.spec, SinkFullAttentionSpec):
            usable -= g.spec.sink_len // g.spec.block_size
    return max(usable, 0) // len(groups) * min(g.spec.block_size for g in groups)


def cap_max_model_len(model_max_len: int, pool_tokens: int) -> int:
    """A request alone must always fit in the pool, else it would preempt
    itself forever: cap the context at the pool."""
    if pool_tokens < model_max_len:
        log.warning("max_model_len_capped_by_kv_cache", model=model_max_len, kv_cache_tokens=pool_tokens)
        return pool_tokens
    return model_max_len


def check_batch_budget(sched: SchedulerConfig, max_model_len: int) -> None:
    """Without chunked prefill a whole prompt must fit in one step's budget."""
    if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"scheduler.max_num_batched_tokens ({sched.max_num_batched_tokens}) must be >= "
            f"max_model_len ({max_model_len}) when chunked prefill is disabled"
        )


def kv_dtype(layer_specs: LayerSpecs) -> str:
    """The dtype of the attention KV (part of the cache identity)."""
    dtypes = sorted({s.dtype for s in layer_specs.values() if isinstance(s, AttentionSpec)})
    return "+".join(dtypes) or "none"


def cache_identity(cache: CacheConfig, layer_specs: LayerSpecs, model_fingerprint: str) -> CacheIdentity:
    """What two caches must share to share a block."""
    return CacheIdentity(
        model_fingerprint=model_fingerprint, kv_dtype=kv_dtype(layer_specs), kv_layout=cache.kv_layout,
        block_size=cache.block_size, hash_algo=cache.hash_algo, namespace=cache.cache_namespace,
    )


def build_block_hasher(cache: CacheConfig, identity: CacheIdentity, *, with_connector: bool) -> BlockHasher | None:
    """Requests hash their blocks when the prefix cache or a connector reads the hashes."""
    if not (cache.enable_prefix_caching or with_connector):
        return None
    return make_block_hasher(identity, random_root=cache.random_hash_root)


# -- the parts ----------------------------------------------------------------------

def build_kv_cache_manager(cache: CacheConfig, layer_specs: LayerSpecs, *, max_model_len: int) -> KVCacheManager:
    """The device KV cache manager for a model's layer specs: the pool
    (``cache.num_blocks``, else sized from ``kv_cache_memory_mib``), the
    coordinator and one manager per group."""
    groups = kv_cache_groups(layer_specs)
    check_block_size(cache, groups)
    check_prefix_caching(cache, groups)
    return KVCacheManager(
        KVCacheConfig(num_blocks=resolve_num_blocks(cache, layer_specs), groups=groups),
        max_model_len=max_model_len, enable_caching=cache.enable_prefix_caching, log_stats=True,
        enable_events=cache.kv_events_endpoint is not None or cache.enable_kv_events,
        metrics_sample_rate=cache.metrics_sample_rate,
        hash_block_size=cache.block_size,
    )


def build_scheduler(
    config: EngineConfig,
    layer_specs: LayerSpecs,
    *,
    max_model_len: int,
    connector: KVConnectorScheduler | None = None,
) -> Scheduler:
    """A scheduler over a new KV cache manager (``scheduler.kv``)."""
    kv = build_kv_cache_manager(config.cache, layer_specs, max_model_len=max_model_len)
    return Scheduler(config.scheduler, kv, max_model_len=max_model_len,
                     enable_prefix_caching=config.cache.enable_prefix_caching, connector=connector)


def build_runner(config: EngineConfig) -> ModelRunnerLike:
    """The runner ``config.executor`` names (blocking: loads the model)."""
    if config.executor == "null":
        from kvstrata.worker.null_runner import NullModelRunner as runner_cls
    else:
        from kvstrata.worker.model_runner import ModelRunner as runner_cls  # type: ignore[assignment]
    sp = config.speculative
    return runner_cls(config.model, config.cache, config.device, config.scheduler,
                      max_drafts=sp.num_speculative_tokens if sp.method is not None else 0)


def connector_spec(identity: CacheIdentity, layer_specs: LayerSpecs, max_model_len: int) -> ConnectorSpec:
    """What the connector's two sides know of this engine. Its tiers store
    one chunk layout for every layer: full attention of one shape."""
    specs = set(layer_specs.values())
    spec = next(iter(specs))
    if len(specs) != 1 or type(spec) is not FullAttentionSpec:
        raise ValueError("a KV connector (kv_transfer) needs a model whose layers are all full attention of one shape")
    return ConnectorSpec(identity=identity, num_layers=len(layer_specs), num_kv_heads=spec.num_kv_heads,
                         head_size=spec.head_size, dtype=spec.dtype, max_model_len=max_model_len)


def attach_connector(connector: KVConnector, runner: ModelRunnerLike, spec: ConnectorSpec) -> KVConnectorScheduler:
    """Build the connector's two sides for this engine; the worker side goes
    to the runner. Returns the scheduler side."""
    set_worker = getattr(runner, "set_kv_connector", None)
    if not callable(set_worker):
        raise ValueError(f"runner {type(runner).__name__} cannot run a KV connector (kv_transfer)")
    sched_side = connector.scheduler_side(spec)
    set_worker(connector.worker_side(spec))
    return sched_side


def build_engine_core(
    config: EngineConfig,
    runner: ModelRunnerLike | None = None,
    connector: KVConnector | KVConnectorScheduler | None = None,
) -> EngineCore:
    """The engine core for ``config`` (blocking when it loads the model).

    ``runner`` replaces the one ``config.executor`` names (tests, tools).
    ``connector``: a KV connector (``kvstrata.connector.KVConnector``, whose
    two sides are built here), or a scheduler side alone (tests), or None.
    """
    config.validate()
    runner = runner if runner is not None else build_runner(config)
    layer_specs = runner.kv_cache_spec()
    num_blocks = resolve_num_blocks(config.cache, layer_specs)
    config = msgspec.structs.replace(config, cache=msgspec.structs.replace(config.cache, num_blocks=num_blocks))
    cache = config.cache
    max_model_len = cap_max_model_len(runner.max_model_len,
                                      pool_token_capacity(kv_cache_groups(layer_specs), num_blocks))
    check_batch_budget(config.scheduler, max_model_len)
    limit = getattr(runner, "limit_max_model_len", None)
    if callable(limit):  # its block tables as wide as a request can be
        limit(max_model_len)
    identity = cache_identity(cache, layer_specs, runner.model_fingerprint)
    hasher = build_block_hasher(cache, identity, with_connector=connector is not None)
    kv_connector = connector if isinstance(connector, KVConnector) else None
    sched_side = connector
    if kv_connector is not None:
        sched_side = attach_connector(kv_connector, runner, connector_spec(identity, layer_specs, max_model_len))
    scheduler = build_scheduler(config, layer_specs, max_model_len=max_model_len,
                                connector=sched_side)  # type: ignore[arg-type]
    runner.initialize_kv_cache(num_blocks)
    return EngineCore(config, runner, scheduler, identity=identity, block_hasher=hasher, kv_connector=kv_connector)
