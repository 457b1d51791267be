"""The KV connector API: how the engine reaches an external KV store.

A connector has two sides, vLLM's KVConnectorBase_V1 split by role:

    scheduler side (event loop, plans; never blocks)     worker side (step thread, moves bytes)
    ─────────────────────────────────────────────────     ─────────────────────────────────────
    prefetch(req)                (a hint, on arrival)     register_kv_caches(kv_caches)
    get_num_new_matched_tokens(req, n_local)              bind_connector_metadata(meta)
        -> (n_external | None, load_async)
    update_state_after_alloc(req, block_ids, n_ext)       start_load_kv()
    request_preempted(req, block_ids)                     wait_for_layer_load(i)  (before layer i)
    build_connector_meta(scheduler_output) -> meta ───►   save_kv_layer(i)        (after layer i)
    update_connector_output(runner_output)    ◄───────    wait_for_save()
    request_finished(req, block_ids) -> (delay, params)   get_finished(finished_ids) -> (sending, recving)
    take_events(), stats(), has_pending_work()            get_block_ids_with_load_errors()
    step_failed(scheduler_output)                         take_report() -> report Struct | None
        -> (sending, recving, invalid block ids)
                                                          clear_connector_metadata()

``n_external`` None means "not known yet" (a lookup is in flight): the
request stays waiting and is asked again next step. ``load_async`` parks the
request in WAITING_FOR_REMOTE_KVS until the worker names it in
``finished_recving``. ``delay`` keeps a finished request's blocks until the
worker names it in ``finished_sending``. The metadata and the worker's
report are msgspec Structs of plain data; the scheduler side receives the
report through ``ModelRunnerOutput.kv_connector_stats``.

A *connector* (``KVConnector``) is the configured pair: it opens any shared
resources on the engine's event loop (the tiered store), then builds one
scheduler side and one worker side for an engine (``ConnectorSpec``).
"""

from __future__ import annotations

import enum
from typing import Any, Protocol, runtime_checkable

import msgspec

from kvstrata.kv.hashing import CacheIdentity


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


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


@runtime_checkable
class KVConnectorScheduler(Protocol):
    def prefetch(self, request: Any) -> None: ...

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(
        self, request: Any, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None: ...

    def request_preempted(self, request: Any, block_ids: tuple[list[int], ...]) -> None: ...

    def build_connector_meta(self, scheduler_output: Any) -> Any: ...

    def update_connector_output(self, runner_output: Any) -> None: ...

    def request_finished(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]: ...

    def step_failed(self, scheduler_output: Any) -> tuple[list[str], list[str], list[int]]: ...

    def take_events(self) -> list: ...

    def stats(self) -> dict[str, float]: ...

    def has_pending_work(self) -> bool: ...


@runtime_checkable
class KVConnectorWorker(Protocol):
    def register_kv_caches(self, kv_caches: list, device: Any) -> None: ...

    def bind_connector_metadata(self, metadata: Any) -> None: ...

    def start_load_kv(self) -> None: ...

    def wait_for_layer_load(self, layer: int) -> None: ...

    def save_kv_layer(self, layer: int) -> None: ...

    def wait_for_save(self) -> None: ...

    def get_finished(self, finished_req_ids: list[str]) -> tuple[set[str], set[str]]: ...

    def get_block_ids_with_load_errors(self) -> set[int]: ...

    def take_report(self) -> Any: ...

    def clear_connector_metadata(self) -> None: ...


@runtime_checkable
class KVConnector(Protocol):
    """One configured connector: ``await cls.open(config, factory)`` on the
    engine loop, then ``scheduler_side(spec)`` and ``worker_side(spec)``
    (each at most once); ``flush`` waits until every save reached every
    tier; ``aclose`` is idempotent."""

    async def flush(self) -> None: ...

    def scheduler_side(self, spec: ConnectorSpec) -> KVConnectorScheduler: ...

    def worker_side(self, spec: ConnectorSpec) -> KVConnectorWorker: ...

    async def aclose(self) -> None: ...


class NoOpScheduler:
    """No external store: no hits, nothing to load or save, never delays a free."""

    is_noop = True

    def prefetch(self, request: Any) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Any, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        return None

    def request_preempted(self, request: Any, block_ids: tuple[list[int], ...]) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return None

    def update_connector_output(self, runner_output: Any) -> None:
        return None

    def request_finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def step_failed(self, scheduler_output: Any) -> tuple[list[str], list[str], list[int]]:
        return [], [], []

    def take_events(self) -> list:
        return []

    def stats(self) -> dict[str, float]:
        return {}

    def has_pending_work(self) -> bool:
        return False


class NoOpWorker:
    """The worker side of no connector: every hook returns at once."""

    is_noop = True

    def register_kv_caches(self, kv_caches: list, device: Any) -> None:
        return None

    def bind_connector_metadata(self, metadata: Any) -> None:
        return None

    def start_load_kv(self) -> None:
        return None

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

    def take_report(self) -> Any:
        return None

    def clear_connector_metadata(self) -> None:
        return None


class NoOpConnector:
    """The "noop" connector: both sides do nothing (tests, a baseline)."""

    @classmethod
    async def open(cls, config: Any, factory: Any = None) -> NoOpConnector:
        return cls()

    async def flush(self) -> None:
        return None

    def scheduler_side(self, spec: ConnectorSpec) -> NoOpScheduler:
        return NoOpScheduler()

    def worker_side(self, spec: ConnectorSpec) -> NoOpWorker:
        return NoOpWorker()

    async def aclose(self) -> None:
        return None
