"""MultiConnector: several connectors chained, e.g. a local offload store in
front of a remote one.

    KVTransferConfig(connector="multi", options={"connectors": [
        {"connector": "offload", "options": {...local tiers...}},
        {"connector": "offload", "options": {...redis...}}]})

Loads: the children are asked in order and the first one with a hit loads
the request (the others are told they load nothing); while a child before it
cannot tell yet, the answer is "not known yet". Saves: every child saves. A
finished request's blocks are held until every child that asked to hold
them reports its save done.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from kvstrata.connector.base import (
    Blender,
    BlockIds,
    BlockTables,
    ConnectorMetadata,
    ConnectorOpener,
    ConnectorRequest,
    ConnectorSpec,
    KVCaches,
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVParams,
)
from kvstrata.connector.config import KVTransferConfig
from kvstrata.connector.metadata import MultiMetadata, MultiReport
from kvstrata.kv.events import AnyKVCacheEvent
from kvstrata.types import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    import torch


class MultiConnector:
    """Owns: its child connectors (opened in order, closed in reverse)."""

    def __init__(self, children: list[KVConnector]) -> None:
        self.children = children
        self._closed = False

    @classmethod
    async def open(cls, config: KVTransferConfig, factory: ConnectorOpener | None = None) -> MultiConnector:
        if factory is None:
            from kvstrata.connector.factory import KVConnectorFactory

            factory = KVConnectorFactory()
        raw = config.options.get("connectors")
        if not isinstance(raw, list) or not raw:
            raise ValueError("kv_transfer.options.connectors must be a non-empty list of connector tables")
        children: list[KVConnector] = []
        try:
            for i, item in enumerate(raw):
                prefix = f"kv_transfer.options.connectors[{i}]"
                if not isinstance(item, dict):
                    raise ValueError(f"{prefix} must be a table")
                try:
                    child = msgspec.convert({"role": config.role, **item}, KVTransferConfig)
                except msgspec.ValidationError as e:
                    raise ValueError(f"{prefix}: {e}") from None
                children.append(await factory.open(child, prefix))
        except BaseException:
            for c in reversed(children):
                await c.aclose()
            raise
        return cls(children)

    def scheduler_side(self, spec: ConnectorSpec) -> MultiScheduler:
        return MultiScheduler([c.scheduler_side(spec) for c in self.children])

    def worker_side(self, spec: ConnectorSpec) -> MultiWorker:
        return MultiWorker([c.worker_side(spec) for c in self.children])

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        for c in self.children:
            c.set_wakeup(callback)

    async def flush(self) -> None:
        for c in self.children:
            await c.flush()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for c in reversed(self.children):
            await c.aclose()


class MultiScheduler:
    """Owns: which child loads each request, and how many children hold
    each finished request's blocks."""

    def __init__(self, children: list[KVConnectorScheduler]) -> None:
        self.children = children
        self._loader: dict[str, int] = {}
        self._expect: dict[str, int] = {}

    def bind_block_tables(self, tables: BlockTables) -> None:
        for child in self.children:
            child.bind_block_tables(tables)

    def prefetch(self, request: ConnectorRequest) -> None:
        for child in self.children:
            child.prefetch(request)

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._loader.pop(request.request_id, None)
        for i, child in enumerate(self.children):
            n, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if n is None:
                return None, False
            if n > 0:
                self._loader[request.request_id] = i
                return n, load_async
        return 0, False

    def load_point(self, request: ConnectorRequest) -> int | None:
        points = [p for child in self.children if (p := child.load_point(request)) is not None]
        return min(points) if points else None

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        chosen = self._loader.pop(request.request_id, -1)
        for i, child in enumerate(self.children):
            child.update_state_after_alloc(request, block_ids, num_external_tokens if i == chosen else 0)

    def request_preempted(self, request: ConnectorRequest, block_ids: BlockIds) -> None:
        for child in self.children:
            child.request_preempted(request, block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiMetadata | None:
        metas: list[object] = [c.build_connector_meta(scheduler_output) for c in self.children]
        if all(m is None for m in metas) and not self._expect:
            return None
        return MultiMetadata(children=metas, expect_sending=dict(self._expect))

    def update_connector_output(self, runner_output: ModelRunnerOutput) -> None:
        report = runner_output.kv_connector_stats
        reports = report.children if isinstance(report, MultiReport) else [None] * len(self.children)
        for child, r in zip(self.children, reports, strict=True):
            child.update_connector_output(msgspec.structs.replace(runner_output, kv_connector_stats=r))
        for rid in runner_output.finished_sending:
            self._expect.pop(rid, None)

    def request_finished(self, request: ConnectorRequest, block_ids: BlockIds) -> tuple[bool, KVParams | None]:
        self._loader.pop(request.request_id, None)
        delays, params = 0, None
        for child in self.children:
            delay, p = child.request_finished(request, block_ids)
            delays += bool(delay)
            params = params or p
        if delays:
            self._expect[request.request_id] = delays
        return delays > 0, params

    def step_failed(self, scheduler_output: SchedulerOutput) -> tuple[list[str], list[str], list[int]]:
        sending: set[str] = set()
        recving: set[str] = set()
        invalid: set[int] = set()
        meta = scheduler_output.kv_connector_metadata
        metas = meta.children if isinstance(meta, MultiMetadata) else [None] * len(self.children)
        for child, m in zip(self.children, metas, strict=True):
            # each child finds the step that failed in its own metadata
            s, r, b = child.step_failed(msgspec.structs.replace(scheduler_output, kv_connector_metadata=m))
            sending.update(s)
            recving.update(r)
            invalid.update(b)
        for rid in sending:
            self._expect.pop(rid, None)
        return sorted(sending), sorted(recving), sorted(invalid)

    def take_events(self) -> list[AnyKVCacheEvent]:
        return [e for c in self.children for e in c.take_events()]

    def snapshot_events(self) -> list[AnyKVCacheEvent]:
        return [e for c in self.children for e in getattr(c, "snapshot_events", list)()]

    def stats(self) -> dict[str, float]:
        return {f"multi{i}.{k}": v for i, c in enumerate(self.children) for k, v in c.stats().items()}

    def hit_tokens(self) -> int:
        return sum(c.hit_tokens() for c in self.children)

    def has_pending_work(self) -> bool:
        return bool(self._expect) or any(c.has_pending_work() for c in self.children)


class MultiWorker:
    """Owns: per finished request, how many children reported its save done."""

    def __init__(self, children: list[KVConnectorWorker]) -> None:
        self.children = children
        self._expect: dict[str, int] = {}
        self._seen: dict[str, int] = {}

    def register_kv_caches(self, kv_caches: KVCaches, device: torch.device | str) -> None:
        for c in self.children:
            c.register_kv_caches(kv_caches, device)

    def bind_connector_metadata(self, metadata: ConnectorMetadata | None) -> None:
        metas = metadata.children if isinstance(metadata, MultiMetadata) else [None] * len(self.children)
        if isinstance(metadata, MultiMetadata):
            self._expect = dict(metadata.expect_sending)
        for c, m in zip(self.children, metas, strict=True):
            c.bind_connector_metadata(m)  # type: ignore[arg-type]  # a child's own metadata or None

    def start_load_kv(self) -> None:
        for c in self.children:
            c.start_load_kv()

    def set_blender(self, blender: Blender) -> bool:
        return any([c.set_blender(blender) for c in self.children])  # every child is offered it

    def loads_layer_by_layer(self) -> bool:
        return any(c.loads_layer_by_layer() for c in self.children)

    def wait_for_layer_load(self, layer: int) -> None:
        for c in self.children:
            c.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int) -> None:
        for c in self.children:
            c.save_kv_layer(layer)

    def wait_for_save(self) -> None:
        for c in self.children:
            c.wait_for_save()

    def get_finished(self, finished_req_ids: list[str]) -> tuple[set[str], set[str]]:
        sending: set[str] = set()
        recving: set[str] = set()
        for c in self.children:
            s, r = c.get_finished(finished_req_ids)
            recving |= r
            for rid in s:
                self._seen[rid] = self._seen.get(rid, 0) + 1
        for rid, n in list(self._seen.items()):
            if n >= self._expect.get(rid, 1):
                sending.add(rid)
                del self._seen[rid]
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set().union(*(c.get_block_ids_with_load_errors() for c in self.children))

    def take_report(self) -> MultiReport | None:
        reports: list[object] = [c.take_report() for c in self.children]
        return None if all(r is None for r in reports) else MultiReport(children=reports)

    def clear_connector_metadata(self) -> None:
        for c in self.children:
            c.clear_connector_metadata()
