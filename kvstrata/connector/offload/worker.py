"""The offload connector's worker side: moves chunk bytes between the lent
host buffers and the paged device cache, in the model runner's step thread.

Order within one step (``kvstrata.kernels.KVStreams``: store and load streams
on CUDA, inline on CPU)::

    start_load_kv      bulk saves (finished / preempted requests: their blocks
                       may be handed to others this very step, so they are read
                       first and compute waits for them), blends (CacheBlend: the
                       model side's ``blender`` builds the KV of a request's
                       segments, written into its blocks; the request computes
                       this step, so compute waits for them), bulk loads
                       (requests in WAITING_FOR_REMOTE_KVS: compute does not
                       wait), then layer 0 of the layer loads
    layer i:  wait_for_layer_load(i)   issue layer i+1's loads, wait for layer i's
              forward of layer i
              save_kv_layer(i)         gather layer i of the chunks that filled up
    wait_for_save      every transfer of the step is complete (a step that
                       fails before it: ``clear_connector_metadata`` waits)

Every transfer goes by ``_Batch``: with ``batched_layer_transfers`` (the
default) a batch is all of a step's chunks of one length (bulk
loads: of one request), their slots joined and copied to the device once
per step, moved by one ``KVStreams`` segment call (per layer, for layer
transfers); without it, a batch is one chunk and its slots stay on the host
(the copy rides with each call). With ``staged_layer_transfers`` a batch of
layer transfers goes through one device buffer of whole chunks per step,
its host copies a run of layers at a time (``KVStreams.stage_loads`` /
``stage_saves``): loads scatter each layer from it, saves gather each layer
into it. A batch that raises fails every chunk in it.

A transfer that raises is reported failed: a failed load's blocks go to
``get_block_ids_with_load_errors`` (the scheduler recomputes them), a failed
save is dropped. Never touches the store or any loop-owned state.
"""

from __future__ import annotations

import time

import numpy as np
import structlog
import torch

from kvstrata.connector.base import Blender, ConnectorMetadata, ConnectorSpec, KVCaches
from kvstrata.connector.metadata import BlendLoad, ChunkTransfer, OffloadMetadata, RequestTransfer, WorkerReport
from kvstrata.kernels import KVStreams, StagedChunks

log = structlog.get_logger(__name__)


class _Xfer:
    __slots__ = ("handle", "buf", "slots", "req_id", "block_ids")

    def __init__(self, handle: int, buf: torch.Tensor, slots: torch.Tensor, req_id: str, block_ids: list[int]) -> None:
        self.handle, self.buf, self.slots, self.req_id, self.block_ids = handle, buf, slots, req_id, block_ids


class _Batch:
    """Chunks of one length moved together: one ``KVStreams`` call (per
    layer, for layer transfers). ``slots``: theirs in order; ``staged``:
    their device buffer, for staged layer transfers."""

    __slots__ = ("xfers", "slots", "alive", "staged")

    def __init__(self, xfers: list[_Xfer], slots: torch.Tensor) -> None:
        self.xfers, self.slots, self.alive = xfers, slots, True
        self.staged: StagedChunks | None = None


# Staged layer transfers: host copies per batch and step (chunks x layer
# groups); fewer groups than layers when there are many chunks
STAGED_COPIES = 64


class OffloadWorker:
    """Owns: the KV streams, the bound metadata and this step's transfers and
    results. Reads the lent buffers; the step thread only."""

    def __init__(self, spec: ConnectorSpec, buffers: dict[int, torch.Tensor], *,
                 batched_layer_transfers: bool | None = None, staged_layer_transfers: bool = False) -> None:
        self.spec = spec
        self._batched_option = batched_layer_transfers
        self.staged = staged_layer_transfers
        self.batched = False  # set by register_kv_caches: the option (None: on)
        self.block_size = spec.block_size
        self.buffers = buffers
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.streams: KVStreams | None = None
        self.blender: Blender | None = None  # set by the model side (kvstrata.worker.blend); None: cannot blend
        self._arange = np.arange(spec.block_size, dtype=np.int64)
        self._reset(None)

    def _reset(self, meta: OffloadMetadata | None) -> None:
        self.meta = meta
        self._layer_loads: list[_Xfer] = []
        self._load_batches: list[_Batch] = []
        self._layer_saves: list[_Xfer] = []
        self._save_batches: list[_Batch] = []
        self._saved: list[int] = []
        self._loaded: list[int] = []
        self._failed: set[int] = set()
        self._invalid: set[int] = set()
        self._recving: set[str] = set()
        self._waited = False  # wait_for_save returned: every transfer of the step is complete
        self._load_s: dict[str, float] = {}
        self._save_s = 0.0
        self._hook_s = 0.0
        self._t_forward = 0.0
        self._forward_s = 0.0

    def register_kv_caches(self, kv_caches: KVCaches, device: torch.device | str) -> None:
        if len(kv_caches) != self.spec.num_layers:
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, the connector spec {self.spec.num_layers}")
        self.kv_caches = list(kv_caches)
        self.streams = KVStreams(torch.device(device), len(kv_caches))
        opt = self._batched_option
        self.batched = True if opt is None else bool(opt)

    def bind_connector_metadata(self, metadata: ConnectorMetadata | None) -> None:
        self._reset(metadata if isinstance(metadata, OffloadMetadata) else None)

    def clear_connector_metadata(self) -> None:
        if self.meta is not None and not self._waited and self.streams is not None:
            # The step failed before wait_for_save: its copies may still run,
            # and the lent buffers and blocks they touch go back to their
            # owners once the failure is reported.
            try:
                self.streams.synchronize()
            except Exception:
                log.exception("kv_transfers_drain_failed", step=self.meta.step)
        self._reset(None)

    # -- before the forward ------------------------------------------------------
    def start_load_kv(self) -> None:
        meta = self.meta
        if meta is None:
            return
        if self.kv_caches is None or self.streams is None:
            raise RuntimeError("register_kv_caches() must be called before the first step")
        t0 = time.perf_counter()
        for b in self._batches([self._xfer(ch, rt.req_id) for rt in meta.bulk_saves for ch in rt.chunks]):
            self._bulk_save(b)
        if meta.bulk_saves and self.streams.is_cuda:
            # Blocks just read may be reloaded or rewritten by this step.
            torch.cuda.current_stream(self.streams.device).wait_stream(self.streams.store_stream)
        t1 = time.perf_counter()
        self._save_s += t1 - t0
        for bl in meta.blend_loads:  # first: the forward waits for these, not for the bulk loads
            self._blend(bl)
        for rt in meta.bulk_loads:
            self._bulk_load(rt)
        for rt in meta.layer_loads:
            self._invalid.update(rt.failed_block_ids)
            self._layer_loads.extend(self._xfer(ch, rt.req_id) for ch in rt.chunks)
        self._layer_saves = [self._xfer(ch, rt.req_id) for rt in meta.layer_saves for ch in rt.chunks]
        self._save_batches = self._batches(self._layer_saves)
        self._load_batches = self._batches(self._layer_loads)
        if self.staged:
            for b in self._load_batches:
                self._stage(b, self.streams.stage_loads, "kv_load_failed", self._load_failed)
            for b in self._save_batches:
                self._stage(b, self.streams.stage_saves, "kv_save_failed", self._save_failed)
        if self._layer_loads and self.streams.is_cuda:
            self._issue_layer(0)
        self._t_forward = time.perf_counter()

    def _xfer(self, ch: ChunkTransfer, req_id: str) -> _Xfer:
        buf = self.buffers[ch.handle]
        n = buf.shape[2]
        flat = self._block_slots(ch.block_ids)
        slots = np.full(n, -1, dtype=np.int64)
        slots[ch.skip:ch.limit] = flat[ch.skip:ch.limit]
        return _Xfer(ch.handle, buf, torch.from_numpy(slots), req_id, list(ch.block_ids))

    def _batches(self, xfers: list[_Xfer]) -> list[_Batch]:
        """Batched: ``xfers`` by chunk length (chunks of one store have one
        length but a request's last, shorter one), each batch's slots copied
        to the device once for the step's layers. Else one batch a chunk."""
        if not self.batched:
            return [_Batch([x], x.slots) for x in xfers]
        by_len: dict[int, list[_Xfer]] = {}
        for x in xfers:
            by_len.setdefault(x.buf.shape[2], []).append(x)
        batches = []
        for group in by_len.values():
            slots = group[0].slots if len(group) == 1 else torch.cat([x.slots for x in group])
            if self.streams.is_cuda:
                slots = slots.pin_memory().to(self.streams.device, non_blocking=True)
            batches.append(_Batch(group, slots))
        return batches

    def _block_slots(self, block_ids: list[int]) -> np.ndarray:
        """The cache slots of ``block_ids``, in order."""
        blocks = np.asarray(block_ids, dtype=np.int64)
        return (blocks[:, None] * self.block_size + self._arange).reshape(-1)

    def _bulk_save(self, b: _Batch) -> None:
        try:
            self.streams.store_all_segments(self.kv_caches, b.slots, [x.buf for x in b.xfers])
            self._saved.extend(x.handle for x in b.xfers)
        except Exception:
            log.exception("kv_save_failed", request_ids=sorted({x.req_id for x in b.xfers}), chunks=len(b.xfers))
            self._failed.update(x.handle for x in b.xfers)

    def _bulk_load(self, rt: RequestTransfer) -> None:
        t0 = time.perf_counter()
        self._invalid.update(rt.failed_block_ids)
        for b in self._batches([self._xfer(ch, rt.req_id) for ch in rt.chunks]):
            try:
                self.streams.load_all_segments([x.buf for x in b.xfers], self.kv_caches, b.slots)
                self._loaded.extend(x.handle for x in b.xfers)
            except Exception:
                log.exception("kv_load_failed", request_id=rt.req_id, chunks=len(b.xfers))
                for x in b.xfers:
                    self._load_failed(x)
        self._recving.add(rt.req_id)
        self._load_s[rt.req_id] = self._load_s.get(rt.req_id, 0.0) + time.perf_counter() - t0

    def _blend(self, bl: BlendLoad) -> None:
        """Build the request's KV for tokens [0, end) from its segments and
        write it into its blocks; on any failure its blocks are reported
        (the scheduler recomputes them)."""
        t0 = time.perf_counter()
        end = len(bl.token_ids)
        try:
            if self.blender is None:
                raise RuntimeError("no blender: this model cannot blend")
            cached = [self.buffers[h] if h >= 0 else None for h in bl.cached]
            kv, fresh = self.blender(bl.token_ids, bl.segments, cached, bl.recompute_ratio)
            slots = np.ascontiguousarray(self._block_slots(bl.block_ids)[bl.skip:end])
            loaded = self.streams.load_all(kv[:, :, bl.skip:].contiguous(), self.kv_caches, torch.from_numpy(slots))
            self.streams.wait_loaded(loaded)  # the request computes in this step, reading these blocks
            self._loaded.extend(h for h in bl.cached if h >= 0)
            for h, seg in zip(bl.saves, fresh, strict=True):
                if h >= 0 and seg is not None:
                    self.buffers[h].copy_(seg)
                    self._saved.append(h)
                elif h >= 0:
                    self._failed.add(h)
        except Exception:
            log.exception("kv_blend_failed", request_id=bl.req_id)
            self._failed.update(h for h in (*bl.cached, *bl.saves) if h >= 0)
            self._invalid.update(bl.block_ids[bl.skip // self.block_size:])
        self._load_s[bl.req_id] = self._load_s.get(bl.req_id, 0.0) + time.perf_counter() - t0

    def _load_failed(self, x: _Xfer) -> None:
        self._failed.add(x.handle)
        self._invalid.update(x.block_ids)

    def _save_failed(self, x: _Xfer) -> None:
        self._failed.add(x.handle)

    # -- layer by layer ------------------------------------------------------------
    def set_blender(self, blender: Blender) -> bool:
        self.blender = blender
        return True

    def loads_layer_by_layer(self) -> bool:
        return bool(self._layer_loads)

    def wait_for_layer_load(self, layer: int) -> None:
        if not self._layer_loads:
            return
        t0 = time.perf_counter()
        streams = self.streams
        if streams.is_cuda:
            if layer + 1 < self.spec.num_layers:
                self._issue_layer(layer + 1)  # overlaps this layer's compute on the load stream
            streams.wait_layer_loaded(layer)
        else:
            self._issue_layer(layer)
        dt = time.perf_counter() - t0
        self._hook_s += dt
        share = dt / len(self._layer_loads)
        for x in self._layer_loads:
            self._load_s[x.req_id] = self._load_s.get(x.req_id, 0.0) + share

    def _stage(self, b: _Batch, stage, event: str, fail) -> None:
        """Ready ``b``'s chunks for staged layer transfers (``stage``: the
        streams' ``stage_loads`` or ``stage_saves``); a staging that raises
        is logged (``event``) and fails each of the batch's chunks (``fail``)."""
        groups = max(1, STAGED_COPIES // len(b.xfers))
        try:
            b.staged = stage([x.buf for x in b.xfers], self.kv_caches[0][0], groups)
        except Exception:
            log.exception(event, request_ids=sorted({x.req_id for x in b.xfers}), chunks=len(b.xfers))
            b.alive = False
            for x in b.xfers:
                fail(x)

    def _issue_layer(self, layer: int) -> None:
        key_cache, value_cache = self.kv_caches[layer]
        for b in self._load_batches:
            if not b.alive:
                continue
            try:
                if b.staged is not None:
                    self.streams.load_staged_layer(b.staged, layer, key_cache, value_cache, b.slots)
                    continue
                self.streams.load_layer_segments(layer, [x.buf[layer] for x in b.xfers], key_cache, value_cache,
                                                 b.slots)
            except Exception:
                log.exception("kv_load_failed", layer=layer, request_ids=sorted({x.req_id for x in b.xfers}),
                              chunks=len(b.xfers))
                b.alive = False
                for x in b.xfers:
                    self._load_failed(x)

    def save_kv_layer(self, layer: int) -> None:
        if not self._layer_saves:
            return
        t0 = time.perf_counter()
        key_cache, value_cache = self.kv_caches[layer]
        for b in self._save_batches:
            if not b.alive:
                continue
            try:
                if b.staged is not None:
                    self.streams.store_staged_layer(b.staged, layer, key_cache, value_cache, b.slots)
                    continue
                self.streams.store_layer_segments(layer, key_cache, value_cache, b.slots,
                                                  [x.buf[layer] for x in b.xfers])
            except Exception:
                log.exception("kv_save_failed", layer=layer, request_ids=sorted({x.req_id for x in b.xfers}),
                              chunks=len(b.xfers))
                b.alive = False
                self._failed.update(x.handle for x in b.xfers)
        dt = time.perf_counter() - t0
        self._hook_s += dt
        self._save_s += dt

    # -- after the forward ---------------------------------------------------------
    def wait_for_save(self) -> None:
        if self.meta is None:
            return
        self._forward_s = max(0.0, time.perf_counter() - self._t_forward - self._hook_s)
        if self.streams is not None and self.streams.is_cuda:
            t0 = time.perf_counter()
            self.streams.synchronize()
            self._save_s += time.perf_counter() - t0
        self._waited = True
        failed = self._failed
        self._saved.extend(x.handle for x in self._layer_saves if x.handle not in failed)
        self._loaded.extend(x.handle for x in self._layer_loads if x.handle not in failed)

    def get_finished(self, finished_req_ids: list[str]) -> tuple[set[str], set[str]]:
        if self.meta is None:
            return set(), set()
        return set(self.meta.finishing), set(self._recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self._invalid)

    def take_report(self) -> WorkerReport | None:
        meta = self.meta
        if meta is None:
            return None
        return WorkerReport(step=meta.step, saved=list(self._saved), loaded=list(self._loaded),
                            failed=sorted(self._failed), load_s=dict(self._load_s), save_s=self._save_s,
                            forward_s=self._forward_s, forward_tokens=meta.num_tokens)
