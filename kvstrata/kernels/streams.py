"""KVStreams: the compute, store (device -> host) and load (host -> device)
streams, and the events that order KV transfers against the forward pass.

Ordering, per layer, within one forward step:

    load stream     H2D copy ─ scatter ─[loaded[l]]
                                          │ wait_layer_loaded(l)
    compute stream  ... ──────────────────┴─ reshape_and_cache + attention(l) ─[written[l]] ─ ...
                                                                                  │ store_layer(l)
    store stream                                              gather ─ D2H copy ──┴─[done]

* a layer's load completes before its attention reads it (the compute
  stream waits on ``loaded[l]``);
* a store starts only after that layer's KV is written (the store stream
  waits on an event recorded on the compute stream when ``store_layer`` is
  called, i.e. after the caller issued the layer's writes);
* a load starts only after the compute work already issued (the load stream
  waits on the compute stream's position at submission), so a block that an
  earlier step still reads is never overwritten by a reload into it;
* buffers are not reused before their copy completes: every transfer returns
  a :class:`KVTransfer` that keeps its host and device buffers (and the slot
  mapping) alive until its event has completed, and tensors created on one
  stream and read on another are marked with ``record_stream`` so the caching
  allocator cannot hand their memory out early.

Host buffers come from :meth:`KVStreams.alloc_host` (pinned on CUDA hosts, so
copies are truly asynchronous). On CPU there are no streams: every call runs
inline and returns a transfer that is already done, so the engine code is the
same on both.

Each call moves one chunk, or S chunks of one length (``*_segments``): one
gather/scatter launch over a device staging buffer [S, ...] filled or
emptied by one non-blocking copy per chunk, instead of S launches (each
launch costs the host tens to hundreds of microseconds). Layer by layer
that is still a host copy per chunk and layer; staged (``stage_loads`` /
``stage_saves`` then ``load_staged_layer`` / ``store_staged_layer`` per
layer) a step's chunks sit whole in one device buffer, copied a run of
layers at a time, and each layer is one launch into or out of it.

Stores steal little from the forward pass running beside them:

* the gather is a memcpy-speed Triton copy (one short-lived program per
  4 KiB tile): it takes SMs for microseconds, between the forward's kernels;
* the device -> host copy goes from a device staging chunk to pinned host
  memory with ``non_blocking``: the copy engine moves it, no SM does;
* slot mappings given on the host are copied ahead of the side stream's
  wait on the compute stream, so neither the gather nor the scatter waits
  for them, and the host never waits for the forward (a pageable copy
  that the driver stages may wait for its own stream's work);
* the store and load streams have the lowest priority (0, also the default
  stream's). A compute stream created with a higher priority
  (``torch.cuda.Stream(priority=-1)``) wins every contended SM.

Measured (H100, TinyLlama-like forward of 1024 and 4096 tokens, every layer
stored, ``tools/bench_kernels.py``): the forward's device time grew 0.4-0.5%.
A bounded grid (``store_programs``: a few programs looping over the tiles)
was no better, 1.8-2.4% with 8 programs: its long-lived programs hold SMs
that the forward's persistent matmul programs then wait for. What does show
is the host cost of each store call (130-250 us on that machine's CPU),
whenever the forward is host-bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog
import torch

from kvstrata.kernels._checks import (
    INDEX_DTYPES,
    KV_DTYPES,
    KernelArgumentError,
    check_cache_pair,
    check_kv_caches,
    check_shape,
    check_tensor,
)
from kvstrata.kernels.transfer import (
    gather_kv,
    gather_kv_layer,
    gather_kv_layer_segments,
    gather_kv_segments,
    scatter_kv,
    scatter_kv_layer,
    scatter_kv_layer_segments,
    scatter_kv_segments,
)
from kvstrata.kernels.staging import StagedChunks, layer_groups

log = structlog.get_logger(__name__)


class KVTransfer:
    """One submitted copy. Owns: references to the buffers the copy touches,
    held until the copy's event completes (then released by ``done``/``wait``)."""

    __slots__ = ("_event", "_buffers", "result")

    def __init__(self, event: torch.cuda.Event | None, buffers: tuple[torch.Tensor, ...], result: torch.Tensor | None):
        self._event = event
        self._buffers: tuple[torch.Tensor, ...] | None = buffers if event is not None else None
        self.result = result  # the host chunk of a store; None for a load

    def done(self) -> bool:
        """True once the copy has completed; never blocks."""
        if self._event is None or self._event.query():
            self._event, self._buffers = None, None
            return True
        return False

    def order_before(self, stream: torch.cuda.Stream) -> None:
        """What ``stream`` runs from now on starts after the copy (no host wait)."""
        if self._event is not None:
            stream.wait_event(self._event)

    def wait(self) -> None:
        """Block the calling thread until the copy has completed (never call on an event loop)."""
        if self._event is not None:
            self._event.synchronize()
            self._event, self._buffers = None, None


# Lowest CUDA stream priority (larger numbers map to it; torch's range is
# [-3, 0] on an H100, lower numbers first).
SIDE_STREAM_PRIORITY = 0


class KVStreams:
    """Stream and event plumbing for KV offload (store) and reload (load).

    Owns: the store and load streams, the per-layer ``loaded`` events of the
    current step, and the list of in-flight transfers. The compute stream is
    whatever stream is current on the calling thread at each call. Not
    thread-safe: one model runner thread drives it.

    ``store_programs`` bounds the grid of the store-side gathers to that many
    looping programs; None (the default, measured best) gives one program per
    tile (see the module docstring).
    """

    __slots__ = ("device", "num_layers", "store_programs", "_store", "_load", "_loaded", "_inflight",
                 "_host_checked")

    def __init__(
        self, device: torch.device | str, num_layers: int, *, store_programs: int | None = None
    ) -> None:
        device = torch.device(device)
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be cuda or cpu, got {device}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device is cuda but CUDA is not available")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}")
        if store_programs is not None and (
            isinstance(store_programs, bool) or not isinstance(store_programs, int) or store_programs < 1
        ):
            raise ValueError(f"store_programs must be None or an integer >= 1, got {store_programs!r}")
        self.device = device
        self.num_layers = num_layers
        self.store_programs = store_programs
        self._loaded: list[torch.cuda.Event | None] = [None] * num_layers
        self._inflight: list[KVTransfer] = []
        self._host_checked = False
        if device.type == "cuda":
            self._store: torch.cuda.Stream | None = torch.cuda.Stream(device, priority=SIDE_STREAM_PRIORITY)
            self._load: torch.cuda.Stream | None = torch.cuda.Stream(device, priority=SIDE_STREAM_PRIORITY)
        else:
            self._store = self._load = None
        log.info("kv_streams_created", device=str(device), num_layers=num_layers, store_programs=store_programs)

    @property
    def is_cuda(self) -> bool:
        return self._store is not None

    @property
    def compute_stream(self) -> torch.cuda.Stream | None:
        """The stream compute runs on: the calling thread's current stream (None on CPU)."""
        return torch.cuda.current_stream(self.device) if self.is_cuda else None

    @property
    def store_stream(self) -> torch.cuda.Stream | None:
        return self._store

    @property
    def load_stream(self) -> torch.cuda.Stream | None:
        return self._load

    def alloc_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for chunks: pinned on CUDA hosts, plain memory otherwise."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.is_cuda)

    # ---- load: host -> device ------------------------------------------------

    def load_layer(
        self,
        layer: int,
        host_chunk: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> KVTransfer:
        """Copy ``host_chunk`` [2, n, Hkv, D] into layer ``layer``'s slots on the
        load stream; :meth:`wait_layer_loaded` orders that layer's attention after it."""
        self._check_layer(layer)
        if self._load is None:
            scatter_kv_layer(host_chunk, key_cache, value_cache, slot_mapping)
            return KVTransfer(None, (), None)
        return self._load_on_side([host_chunk], slot_mapping, layer, lambda dev, slots: scatter_kv_layer(
            dev[0], key_cache, value_cache, slots))

    def load_layer_segments(
        self,
        layer: int,
        host_chunks: Sequence[torch.Tensor],
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> KVTransfer:
        """:meth:`load_layer` for S chunks at once: ``host_chunks`` S tensors
        [2, n, Hkv, D] (one n), ``slot_mapping`` their S * n slots in order.
        On CUDA: one non-blocking copy per chunk into a device staging buffer
        [S, 2, n, Hkv, D] and one scatter launch (not S launches), on the
        load stream. On CPU: the chunks joined and scattered in one call."""
        self._check_layer(layer)
        check_cache_pair(key_cache, value_cache)
        self._check_segments(host_chunks, (2,), key_cache, slot_mapping)
        if self._load is None:
            chunk = host_chunks[0] if len(host_chunks) == 1 else torch.cat(list(host_chunks), dim=1)
            scatter_kv_layer(chunk, key_cache, value_cache, slot_mapping)
            return KVTransfer(None, (), None)
        return self._load_on_side(host_chunks, slot_mapping, layer, lambda dev, slots: scatter_kv_segments(
            dev.unsqueeze(1), [(key_cache, value_cache)], slots))

    def stage_loads(self, host_chunks: Sequence[torch.Tensor], key_cache: torch.Tensor,
                    num_groups: int) -> StagedChunks:
        """Ready S host chunks [L, 2, n, Hkv, D] (one n, the cache's dtype) for
        :meth:`load_staged_layer`: checked once here, not once per layer. On
        CUDA a device buffer [S, L, 2, n, Hkv, D] (the load stream's) that the
        chunks are copied into ``num_groups`` runs of layers at a time:
        S * num_groups host copies for the step's layer loads instead of
        S * L. On a CPU the chunks stacked (one copy)."""
        chunks, shape, groups = self._staged_args(host_chunks, key_cache, num_groups)
        if self._load is None:
            return StagedChunks(chunks, torch.stack(chunks), groups, num_copied=len(groups))
        with torch.cuda.stream(self._load):
            staging = torch.empty((len(chunks), *shape), dtype=key_cache.dtype, device=self.device)
        return StagedChunks(chunks, staging, groups)

    def load_staged_layer(self, staged: StagedChunks, layer: int, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> KVTransfer:
        """Layer ``layer`` of ``staged`` into the caches' S * n slots (segment s
        to slots [s * n, (s + 1) * n)): one scatter launch; the compute stream
        waits for it at :meth:`wait_layer_loaded`. On CUDA, on the load
        stream: first the copies of the layer's group and the group after it
        that are not queued yet (the next group's copy runs beside this
        layer's compute), then the scatter. The first call of a staging
        waits for the compute stream's work so far (a block an earlier step
        still reads is never overwritten), the later ones do not: within
        the step, a loaded block's layer is read only after its own load."""
        self._check_layer(layer)
        check_cache_pair(key_cache, value_cache)
        check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
        if self._load is None:
            scatter_kv_layer_segments(staged.staging, layer, key_cache, value_cache, slot_mapping)
            return KVTransfer(None, (), None)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._load):
            dev_slots = self._on_side_stream(slot_mapping, self._load)
            if not staged.waited:
                self._load.wait_stream(compute)
                staged.waited = True
            staged.copy_in(min(staged.group_of(layer) + 2, len(staged.groups)))
            scatter_kv_layer_segments(staged.staging, layer, key_cache, value_cache, dev_slots)
            event = torch.cuda.Event()
            event.record(self._load)
        self._loaded[layer] = event
        return self._track(KVTransfer(event, (*staged.host_chunks, staged.staging, dev_slots), None))

    def stage_saves(self, host_outs: Sequence[torch.Tensor], key_cache: torch.Tensor,
                    num_groups: int) -> StagedChunks:
        """Ready S host chunks [L, 2, n, Hkv, D] (contiguous, the cache's dtype)
        to receive :meth:`store_staged_layer`'s layers: checked once here. A
        buffer [S, L, 2, n, Hkv, D] on the device (the store stream's) that
        each layer is gathered into, copied out ``num_groups`` runs of layers
        at a time. Read the host chunks once the last layer's transfer is done."""
        outs, shape, groups = self._staged_args(host_outs, key_cache, num_groups)
        if self._store is None:
            return StagedChunks(outs, torch.empty((len(outs), *shape), dtype=key_cache.dtype), groups)
        with torch.cuda.stream(self._store):
            staging = torch.empty((len(outs), *shape), dtype=key_cache.dtype, device=self.device)
        return StagedChunks(outs, staging, groups)

    def store_staged_layer(self, staged: StagedChunks, layer: int, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> KVTransfer:
        """Layer ``layer``'s K/V at the S * n slots into ``staged`` (slots
        [s * n, (s + 1) * n) to chunk s): one gather launch, after the layer's
        writes (on CUDA on the store stream, after an event on the compute
        stream); when ``layer`` ends its group, that group's copies out to
        the host chunks (one non-blocking copy per chunk). Layers come in
        order, each once per staging."""
        self._check_layer(layer)
        check_cache_pair(key_cache, value_cache)
        check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
        g = staged.group_of(layer)
        if g != staged.num_copied:
            raise KernelArgumentError(f"layer {layer} of a staged save: group {g}, but {staged.num_copied} "
                                      "groups are out (layers come in order, each once)")
        last = layer == staged.groups[g].stop - 1
        if self._store is None:
            gather_kv_layer_segments(key_cache, value_cache, slot_mapping, staged.staging, layer)
            if last:
                staged.copy_out(g)
            return KVTransfer(None, (), None)
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._store):
            dev_slots = self._on_side_stream(slot_mapping, self._store)
            self._store.wait_event(written)
            gather_kv_layer_segments(key_cache, value_cache, dev_slots, staged.staging, layer,
                                     max_programs=self.store_programs)
            if last:
                staged.copy_out(g)
            event = torch.cuda.Event()
            event.record(self._store)
        return self._track(KVTransfer(event, (*staged.host_chunks, staged.staging, dev_slots), None))

    def _staged_args(self, chunks: Sequence[torch.Tensor], key_cache: torch.Tensor,
                     num_groups: int) -> tuple[list[torch.Tensor], tuple[int, ...], list[range]]:
        """The host chunks checked once ([L, 2, n, Hkv, D], one n), their shape and the layer groups."""
        if not chunks:
            raise KernelArgumentError("host chunks: need at least one")
        check_tensor("host chunk", chunks[0], 5, KV_DTYPES)
        shape = (self.num_layers, 2, chunks[0].shape[2], *key_cache.shape[2:])
        checked = [self._host_buffer(c, shape, key_cache.dtype, "host chunk") for c in chunks]
        return checked, shape, layer_groups(self.num_layers, num_groups)

    def load_all(self, host_chunk: torch.Tensor, kv_caches, slot_mapping: torch.Tensor) -> KVTransfer:
        """Copy ``host_chunk`` [L, 2, n, Hkv, D] into every layer's slots on the
        load stream; every layer's :meth:`wait_layer_loaded` orders after it."""
        self._check_all(kv_caches)
        if self._load is None:
            scatter_kv(host_chunk, kv_caches, slot_mapping)
            return KVTransfer(None, (), None)
        return self._load_on_side([host_chunk], slot_mapping, None,
                                  lambda dev, slots: scatter_kv(dev[0], kv_caches, slots))

    def load_all_segments(self, host_chunks: Sequence[torch.Tensor], kv_caches,
                          slot_mapping: torch.Tensor) -> KVTransfer:
        """:meth:`load_all` for S chunks at once: ``host_chunks`` S tensors
        [L, 2, n, Hkv, D] (one n) into the S * n slots of ``slot_mapping``.
        On CUDA: one non-blocking copy per chunk into a device staging buffer
        and one scatter launch, on the load stream."""
        self._check_all(kv_caches, pairs=True)
        n = self._check_segments(host_chunks, (self.num_layers, 2), kv_caches[0][0], slot_mapping)
        if self._load is None:
            for i, chunk in enumerate(host_chunks):
                scatter_kv(chunk, kv_caches, slot_mapping[i * n:(i + 1) * n])
            return KVTransfer(None, (), None)
        return self._load_on_side(host_chunks, slot_mapping, None,
                                  lambda dev, slots: scatter_kv_segments(dev, kv_caches, slots))

    def wait_layer_loaded(self, layer: int) -> None:
        """Make the compute stream wait for the pending load of ``layer`` (no-op if none).

        Loads run in order on one stream, so waiting for the layer's latest
        load covers every earlier one."""
        self._check_layer(layer)
        event = self._loaded[layer]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            self._loaded[layer] = None

    # ---- store: device -> host -----------------------------------------------

    def store_layer(
        self,
        layer: int,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        host_out: torch.Tensor | None = None,
    ) -> KVTransfer:
        """Copy layer ``layer``'s K/V at the slots to the host as [2, n, Hkv, D] on
        the store stream, after everything already issued on the compute stream
        (the layer's reshape_and_cache). ``result`` is the host chunk; read it
        only once the transfer is done."""
        self._check_layer(layer)
        check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
        check_tensor("key_cache", key_cache, 4, KV_DTYPES)
        shape = (2, slot_mapping.shape[0], key_cache.shape[2], key_cache.shape[3])
        host_out = self._host_buffer(host_out, shape, key_cache.dtype)
        if self._store is None:
            gather_kv_layer(key_cache, value_cache, slot_mapping, out=host_out)
            return KVTransfer(None, (), host_out)
        return self._store_on_side(slot_mapping, [host_out], lambda slots: gather_kv_layer(
            key_cache, value_cache, slots, max_programs=self.store_programs).unsqueeze(0))

    def store_layer_segments(
        self,
        layer: int,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        host_outs: Sequence[torch.Tensor],
    ) -> KVTransfer:
        """:meth:`store_layer` for S chunks at once: the S * n slots of
        ``slot_mapping`` into ``host_outs`` (S contiguous tensors [2, n, Hkv, D],
        segment s from slots [s * n, (s + 1) * n)). On CUDA: one gather launch
        into a device staging buffer and one non-blocking copy per chunk, on
        the store stream, after the layer's writes. Read the buffers only
        once the transfer is done."""
        self._check_layer(layer)
        check_cache_pair(key_cache, value_cache)
        n = self._check_segments(host_outs, (2,), key_cache, slot_mapping)
        if self._store is None:
            if len(host_outs) == 1:
                gather_kv_layer(key_cache, value_cache, slot_mapping, out=host_outs[0])
            else:
                gathered = gather_kv_layer(key_cache, value_cache, slot_mapping)
                for i, out in enumerate(host_outs):
                    out.copy_(gathered[:, i * n:(i + 1) * n])
            return KVTransfer(None, (), None)
        return self._store_on_side(slot_mapping, host_outs, lambda slots: gather_kv_segments(
            [(key_cache, value_cache)], slots, len(host_outs), max_programs=self.store_programs)[:, 0])

    def store_all(self, kv_caches, slot_mapping: torch.Tensor, host_out: torch.Tensor | None = None) -> KVTransfer:
        """Like :meth:`store_layer` for every layer at once: host chunk [L, 2, n, Hkv, D]."""
        self._check_all(kv_caches, pairs=True)
        check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
        key0 = kv_caches[0][0]
        shape = (self.num_layers, 2, slot_mapping.shape[0], key0.shape[2], key0.shape[3])
        host_out = self._host_buffer(host_out, shape, key0.dtype)
        if self._store is None:
            gather_kv(kv_caches, slot_mapping, out=host_out)
            return KVTransfer(None, (), host_out)
        return self._store_on_side(slot_mapping, [host_out], lambda slots: gather_kv(
            kv_caches, slots, max_programs=self.store_programs).unsqueeze(0))

    def store_all_segments(self, kv_caches, slot_mapping: torch.Tensor,
                           host_outs: Sequence[torch.Tensor]) -> KVTransfer:
        """:meth:`store_all` for S chunks at once: the S * n slots into
        ``host_outs`` (S contiguous tensors [L, 2, n, Hkv, D]). On CUDA: one
        gather launch into a device staging buffer and one non-blocking copy
        per chunk, on the store stream. Read the buffers once it is done."""
        self._check_all(kv_caches, pairs=True)
        n = self._check_segments(host_outs, (self.num_layers, 2), kv_caches[0][0], slot_mapping)
        if self._store is None:
            for i, out in enumerate(host_outs):
                gather_kv(kv_caches, slot_mapping[i * n:(i + 1) * n], out=out)
            return KVTransfer(None, (), None)
        return self._store_on_side(slot_mapping, host_outs, lambda slots: gather_kv_segments(
            kv_caches, slots, len(host_outs), max_programs=self.store_programs))

    # ---- the side streams' part (CUDA) ------------------------------------------

    def _load_on_side(self, host_chunks: Sequence[torch.Tensor], slot_mapping: torch.Tensor, layer: int | None,
                      scatter: Callable[[torch.Tensor, torch.Tensor], None]) -> KVTransfer:
        """On the load stream, after the compute stream's work so far: the
        chunks to the device as [S, ...] (one non-blocking copy each) and
        ``scatter(staging, device slots)``; ``layer``'s wait (None: every
        layer's) orders after it."""
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._load):
            # the slots first: a pageable copy the driver stages may wait for
            # this stream's work, and must not wait for the compute stream's
            dev_slots = self._on_side_stream(slot_mapping, self._load)
            self._load.wait_stream(compute)
            if len(host_chunks) == 1:
                staging = self._on_side_stream(host_chunks[0], self._load).unsqueeze(0)
            else:
                first = host_chunks[0]
                staging = torch.empty((len(host_chunks), *first.shape), dtype=first.dtype, device=self.device)
                torch._foreach_copy_(list(staging.unbind(0)), list(host_chunks), non_blocking=True)
            scatter(staging, dev_slots)
            event = torch.cuda.Event()
            event.record(self._load)
        if layer is None:
            self._loaded = [event] * self.num_layers
        else:
            self._loaded[layer] = event
        return self._track(KVTransfer(event, (*host_chunks, staging, dev_slots), None))

    def _store_on_side(self, slot_mapping: torch.Tensor, host_outs: Sequence[torch.Tensor],
                       gather: Callable[[torch.Tensor], torch.Tensor]) -> KVTransfer:
        """On the store stream, after the compute stream's work so far (the
        writes of what is stored): ``gather(device slots)`` -> [S, ...] on the
        device, row s copied into ``host_outs[s]`` non-blocking. ``result``:
        the one host buffer of a single-chunk store."""
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._store):
            dev_slots = self._on_side_stream(slot_mapping, self._store)
            self._store.wait_event(written)
            staging = gather(dev_slots)
            if len(host_outs) == 1:
                host_outs[0].copy_(staging[0], non_blocking=True)
            else:
                torch._foreach_copy_(list(host_outs), list(staging.unbind(0)), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._store)
        return self._track(KVTransfer(event, (*host_outs, staging, dev_slots),
                                      host_outs[0] if len(host_outs) == 1 else None))

    # ---- bookkeeping -----------------------------------------------------------

    def num_inflight(self) -> int:
        """Transfers not yet known to be complete (reaps finished ones first)."""
        self._inflight = [t for t in self._inflight if not t.done()]
        return len(self._inflight)

    def synchronize(self) -> None:
        """Block until every submitted transfer has completed, and whatever
        else the store and load streams were given: a call that raised after
        queueing some of its copies returned no transfer to wait on. Every
        transfer runs on one of the two, so their syncs cover all."""
        for stream in (self._store, self._load):
            if stream is not None:
                stream.synchronize()
        self._inflight.clear()

    def wait_loaded(self, transfer: KVTransfer) -> None:
        """Make the compute stream wait for ``transfer`` (a load): what it
        queues next reads the slots written. On a CPU the load is done."""
        if self._load is not None:
            transfer.order_before(torch.cuda.current_stream(self.device))

    def _track(self, transfer: KVTransfer) -> KVTransfer:
        self._inflight.append(transfer)
        if len(self._inflight) > 64:
            self._inflight = [t for t in self._inflight if not t.done()]
        return transfer

    def _host_buffer(self, host_out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                     name: str = "host_out") -> torch.Tensor:
        if host_out is None:
            return self.alloc_host(shape, dtype)
        check_tensor(name, host_out, len(shape), (dtype,))
        check_shape(name, host_out, shape)
        if not host_out.is_contiguous():
            raise KernelArgumentError(f"{name} must be contiguous, got strides {tuple(host_out.stride())}")
        if self.is_cuda and not self._host_checked:
            self._host_checked = True  # once: the connector's buffers all come from one pool
            if not host_out.is_pinned():  # still correct, but each copy then blocks this thread
                log.warning("kv_store_host_buffer_not_pinned", shape=list(shape))
        return host_out

    def _check_all(self, kv_caches, *, pairs: bool = False) -> None:
        """Every layer given; ``pairs``: also check the caches here (the
        kernel checks them again; the segment calls read their shape first)."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"kv_caches must have {self.num_layers} layers, got {len(kv_caches)}")
        if pairs:
            check_kv_caches(kv_caches)

    def _check_segments(self, chunks: Sequence[torch.Tensor], lead: tuple[int, ...], cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> int:
        """The tokens per chunk of S host chunks [*lead, n, Hkv, D] of the
        cache's dtype over S * n slots; host buffers are checked like ``host_out``."""
        check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
        if not chunks:
            raise KernelArgumentError("host chunks: need at least one")
        first = chunks[0]
        check_tensor("host chunk", first, len(lead) + 3, KV_DTYPES)
        n = first.shape[len(lead)]
        shape = (*lead, n, *cache.shape[2:])
        for c in chunks:
            self._host_buffer(c, shape, cache.dtype, "host chunk")
        if slot_mapping.shape[0] != len(chunks) * n:
            raise KernelArgumentError(f"slot_mapping has {slot_mapping.shape[0]} slots, {len(chunks)} chunks of {n} "
                                      f"tokens need {len(chunks) * n}")
        return n

    def _on_side_stream(self, t: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
        """``t`` on the device, safe to read on ``stream``: a host tensor is copied
        there on ``stream``; a device tensor from the compute stream is marked so
        the allocator keeps its memory until ``stream``'s work is done.

        A small pageable tensor (a slot mapping) is staged by the driver and the
        call returns at once; pinning it here instead would cost a pinned
        allocation whenever the pool's blocks are still in flight."""
        if t.device.type != "cuda":
            return t.to(self.device, non_blocking=True)
        t.record_stream(stream)
        return t

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
