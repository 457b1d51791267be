"""The KV connector API: how the engine reaches an external KV store.

A connector has two sides, vLLM's KVConnectorBase_V1 split by role:

    scheduler side (event loop, plans; never blocks)     worker side (step thread, moves bytes)
    ─────────────────────────────────────────────────     ─────────────────────────────────────
    bind_block_tables(kv)        (once, at start)         register_kv_caches(kv_caches, device)
    prefetch(req)                (a hint, on arrival)     bind_connector_metadata(meta)
    get_num_new_matched_tokens(req, n_local)              start_load_kv()
        -> (n_external | None, load_async)                wait_for_layer_load(i)  (before layer i)
    update_state_after_alloc(req, block_ids, n_ext)       save_kv_layer(i)        (after layer i)
    request_preempted(req, block_ids)                     wait_for_save()
    build_connector_meta(scheduler_output) -> meta ───►   get_finished(finished_ids) -> (sending, recving)
    update_connector_output(runner_output)    ◄───────    get_block_ids_with_load_errors()
    request_finished(req, block_ids) -> (delay, params)   take_report() -> report Struct | None
    take_events(), stats(), has_pending_work()            clear_connector_metadata()
    step_failed(scheduler_output)
        -> (sending, recving, invalid block ids)

``n_external`` None means "not known yet" (a lookup is in flight): the
request stays waiting and is asked again next step. ``load_async`` parks the
request in WAITING_FOR_REMOTE_KVS until the worker names it in
``finished_recving``. ``delay`` keeps a finished request's blocks until the
worker names it in ``finished_sending``. The metadata and the worker's
report are msgspec Structs of plain data; the scheduler side receives the
report through ``ModelRunnerOutput.kv_connector_stats``.

The scheduler side reads requests through ``ConnectorRequest`` (the engine's
``Request`` satisfies it) and the device block tables through
``BlockTables`` (the KV cache manager): it keeps no copy of either.

With async scheduling the engine builds step N+1's metadata while step N
runs, before N's ``update_connector_output``: what a metadata lends or
waits for belongs to its step (the worker's report names it) and is settled
when that step comes back; steps come back in order, through
``update_connector_output`` or ``step_failed``. A save may cover KV that an
earlier step in flight writes (the worker runs steps in order), never KV of
a later one (a chunk whose last token is still being sampled has no block
hash yet); ``step_failed`` must drop the saves of the steps queued behind
the failed one, which may have read its KV. The scheduler never schedules a
request on top of a load in flight into its blocks.

A *connector* (``KVConnector``) is the configured pair: it opens any shared
resources on the engine's event loop (the tiered store), then builds one
scheduler side and one worker side for an engine (``ConnectorSpec``).
``set_wakeup(callback)`` gives it the engine's wake-up: the connector calls
it whenever something the engine should step for completes (a lookup
answered, a load landed, a store write finished), so the engine never polls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

import msgspec

from kvstrata.config import KVTransferConfig
from kvstrata.kv.events import AnyKVCacheEvent
from kvstrata.kv.hashing import CacheIdentity
from kvstrata.kv.types import BlockHash
from kvstrata.types import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    import torch

ConnectorMetadata: TypeAlias = msgspec.Struct  # one step's plan, or the worker's report: frozen plain data
BlockIds: TypeAlias = tuple[list[int], ...]  # a request's block ids, one list per KV cache group
KVCaches: TypeAlias = Sequence[tuple["torch.Tensor", "torch.Tensor"]]  # (key, value) cache per layer
JSONValue: TypeAlias = dict[str, "JSONValue"] | list["JSONValue"] | str | int | float | bool | None
KVParams: TypeAlias = dict[str, JSONValue]  # a connector's transfer parameters for a finished request
# The model side's CacheBlend builder (``kvstrata.worker.segment_blender``):
# (token ids, segment spans, each segment's stored KV or None, recompute ratio)
#   -> (the KV of every token, (layers, 2, tokens, kv heads, head size); each
#       segment's KV computed on its own where none was stored, else None)
Blender: TypeAlias = Callable[[list[int], Sequence[tuple[int, int]], list["torch.Tensor | None"], float],
                              tuple["torch.Tensor", list["torch.Tensor | None"]]]


class ConnectorSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What both sides know of the engine they serve: the cache identity
    (every process agreeing on it agrees on every key) and the KV geometry."""

    identity: CacheIdentity
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    max_model_len: int

    @property
    def block_size(self) -> int:
        return self.identity.block_size


class ConnectorRequest(Protocol):
    """What the scheduler side reads of a request: its id, its tokens (the
    prompt, then the outputs so far), the hash of each full block, how many
    tokens the device has computed and, once finished, why."""

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[BlockHash]: ...

    @property
    def finish_reason(self) -> str | None: ...


class BlockTables(Protocol):
    """The device block tables, read-only (the KV cache manager's)."""

    def get_block_ids(self, request_id: str) -> BlockIds: ...


@runtime_checkable
class KVConnectorScheduler(Protocol):
    def bind_block_tables(self, tables: BlockTables) -> None: ...

    def prefetch(self, request: ConnectorRequest) -> None: ...

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]: ...

    def load_point(self, request: ConnectorRequest) -> int | None:
        """Asked after ``get_num_new_matched_tokens`` answered 0 or None: the
        token up to which the scheduler computes ``request`` before asking
        again (the connector loads the stored tokens after it meanwhile:
        compute the front while the back loads); None: no such point."""
        ...

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: BlockIds, num_external_tokens: int
    ) -> None: ...

    def request_preempted(self, request: ConnectorRequest, block_ids: BlockIds) -> None: ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata | None: ...

    def update_connector_output(self, runner_output: ModelRunnerOutput) -> None: ...

    def request_finished(self, request: ConnectorRequest, block_ids: BlockIds) -> tuple[bool, KVParams | None]: ...

    def step_failed(self, scheduler_output: SchedulerOutput) -> tuple[list[str], list[str], list[int]]: ...

    def take_events(self) -> list[AnyKVCacheEvent]: ...

    def stats(self) -> dict[str, float]: ...

    def hit_tokens(self) -> int:
        """Tokens the connector's tiers served, over every finished request
        and tier: the one count of tier hits (``kv.external_hit_tokens``;
        per tier in ``stats``)."""
        ...

    def has_pending_work(self) -> bool: ...


@runtime_checkable
class KVConnectorWorker(Protocol):
    def register_kv_caches(self, kv_caches: KVCaches, device: torch.device | str) -> None: ...

    def bind_connector_metadata(self, metadata: ConnectorMetadata | None) -> None: ...

    def start_load_kv(self) -> None: ...

    def set_blender(self, blender: Blender) -> bool:
        """Offer the model side's CacheBlend builder (``kvstrata.worker.blend``:
        the KV of a request's segments); returns whether this worker blends
        with it (False: it cannot, and keeps nothing)."""
        ...

    def loads_layer_by_layer(self) -> bool:
        """After ``start_load_kv``: whether this step's forward must wait for
        loads layer by layer. When not, the runner may run the forward whole
        (a captured CUDA graph) and call ``save_kv_layer`` for every layer
        after it."""
        ...

    def wait_for_layer_load(self, layer: int) -> None: ...

    def save_kv_layer(self, layer: int) -> None: ...

    def wait_for_save(self) -> None: ...

    def get_finished(self, finished_req_ids: list[str]) -> tuple[set[str], set[str]]: ...

    def get_block_ids_with_load_errors(self) -> set[int]: ...

    def take_report(self) -> ConnectorMetadata | None: ...

    def clear_connector_metadata(self) -> None: ...


class ConnectorOpener(Protocol):
    """What ``KVConnector.open`` may use to open child connectors (the factory)."""

    async def open(self, config: KVTransferConfig, prefix: str = "kv_transfer") -> KVConnector: ...


@runtime_checkable
class KVConnector(Protocol):
    """One configured connector: ``await cls.open(config, factory)`` on the
    engine loop, then ``scheduler_side(spec)`` and ``worker_side(spec)``
    (each at most once); ``set_wakeup`` at any time (the callback is
    thread-safe; the default is none); ``flush`` waits until every save
    reached every tier; ``aclose`` is idempotent."""

    @classmethod
    async def open(cls, config: KVTransferConfig, factory: ConnectorOpener | None = None) -> KVConnector: ...

    def set_wakeup(self, callback: Callable[[], None]) -> None: ...

    async def flush(self) -> None: ...

    def scheduler_side(self, spec: ConnectorSpec) -> KVConnectorScheduler: ...

    def worker_side(self, spec: ConnectorSpec) -> KVConnectorWorker: ...

    async def aclose(self) -> None: ...


# -- no connector -------------------------------------------------------------------

class NoOpConnectorScheduler:
    """The scheduler side of no connector: no hits, nothing to load or save,
    never delays a free."""

    def bind_block_tables(self, tables: BlockTables) -> None:
        return None

    def prefetch(self, request: ConnectorRequest) -> None:
        return None

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def load_point(self, request: ConnectorRequest) -> int | None:
        return None

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        return None

    def request_preempted(self, request: ConnectorRequest, block_ids: BlockIds) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata | None:
        return None

    def update_connector_output(self, runner_output: ModelRunnerOutput) -> None:
        return None

    def request_finished(self, request: ConnectorRequest, block_ids: BlockIds) -> tuple[bool, KVParams | None]:
        return False, None

    def step_failed(self, scheduler_output: SchedulerOutput) -> tuple[list[str], list[str], list[int]]:
        return [], [], []

    def take_events(self) -> list[AnyKVCacheEvent]:
        return []

    def stats(self) -> dict[str, float]:
        return {}

    def hit_tokens(self) -> int:
        return 0

    def has_pending_work(self) -> bool:
        return False


class NoOpConnectorWorker:
    """The worker side of no connector: every hook returns at once."""

    def register_kv_caches(self, kv_caches: KVCaches, device: torch.device | str) -> None:
        return None

    def bind_connector_metadata(self, metadata: ConnectorMetadata | None) -> None:
        return None

    def start_load_kv(self) -> None:
        return None

    def set_blender(self, blender: Blender) -> bool:
        return False

    def loads_layer_by_layer(self) -> bool:
        return False

    def wait_for_layer_load(self, layer: int) -> None:
        return None

    def save_kv_layer(self, layer: int) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: list[str]) -> tuple[set[str], set[str]]:
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def take_report(self) -> ConnectorMetadata | None:
        return None

    def clear_connector_metadata(self) -> None:
        return None


class NoOpConnector:
    """The "noop" connector: both sides do nothing, nothing ever completes
    (tests, a baseline)."""

    @classmethod
    async def open(cls, config: KVTransferConfig, factory: ConnectorOpener | None = None) -> NoOpConnector:
        return cls()

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        return None

    async def flush(self) -> None:
        return None

    def scheduler_side(self, spec: ConnectorSpec) -> NoOpConnectorScheduler:
        return NoOpConnectorScheduler()

    def worker_side(self, spec: ConnectorSpec) -> NoOpConnectorWorker:
        return NoOpConnectorWorker()

    async def aclose(self) -> None:
        return None
