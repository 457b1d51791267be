"""What crosses between the two sides of a connector, as plain-data Structs.

Scheduler -> worker, once per step (``SchedulerOutput.kv_connector_metadata``)::

    OffloadMetadata
      layer_loads   chunks to scatter layer by layer in this step's forward
                    (requests scheduled in this step, chunks already in CPU memory)
      bulk_loads    whole chunks to scatter before the forward, for requests
                    waiting in WAITING_FOR_REMOTE_KVS (reported in finished_recving)
      bulk_saves    whole chunks to gather before the forward: finished and
                    preempted requests, whose blocks may be reused this very step
      layer_saves   chunks that fill up in this step, gathered after each layer
      finishing     finished requests whose blocks are held until their
                    bulk saves are done (reported in finished_sending)

Worker -> scheduler, once per step (``ModelRunnerOutput.kv_connector_stats``):
``WorkerReport`` names the buffers it transferred and the time it took.

Chunk bytes never travel in these Structs: a ``ChunkTransfer.handle`` names a
host buffer that the scheduler side lends for the step (see ``LentBuffers``).
"""

from __future__ import annotations

import msgspec


class ChunkTransfer(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One stored chunk <-> device blocks. Tokens ``[skip, limit)`` of the
    chunk are moved (a load skips what the device already holds and the
    prompt's last token); ``block_ids`` cover the whole chunk."""

    handle: int
    block_ids: list[int]
    skip: int
    limit: int


class RequestTransfer(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The chunks of one request in one direction. ``failed_block_ids``
    (loads only): blocks the store could not deliver, to recompute."""

    req_id: str
    chunks: list[ChunkTransfer]
    failed_block_ids: list[int] = []


class BlendLoad(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """CacheBlend for one request (``connector/offload/segments.py``): its
    tokens ``[0, end)``, the segment spans, per segment the lent handle of
    its stored KV (-1: none, compute it on its own) and of the buffer to save
    it into (-1: no save), the blocks covering ``[0, end)``, the share of
    segment tokens to recompute, and ``skip``: the leading tokens the device
    already holds (not written)."""

    req_id: str
    token_ids: list[int]
    segments: list[tuple[int, int]]
    cached: list[int]
    saves: list[int]
    block_ids: list[int]
    recompute_ratio: float
    skip: int = 0


class OffloadMetadata(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One step's transfers; ``num_tokens`` is the step's computed tokens
    (the worker times the forward pass per token for the metrics)."""

    step: int
    num_tokens: int = 0
    layer_loads: list[RequestTransfer] = []
    bulk_loads: list[RequestTransfer] = []
    bulk_saves: list[RequestTransfer] = []
    layer_saves: list[RequestTransfer] = []
    finishing: list[str] = []
    blend_loads: list[BlendLoad] = []

    @property
    def is_empty(self) -> bool:
        return not (self.layer_loads or self.bulk_loads or self.bulk_saves or self.layer_saves
                    or self.finishing or self.blend_loads)


class WorkerReport(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One step of the offload worker. ``load_s[req_id]`` is the time spent
    moving that request's chunks into the device cache; ``forward_s`` and
    ``forward_tokens`` measure the model (for the recompute-time estimate):
    from the forward's start to ``wait_for_save``, less the time in the
    connector's hooks (the forward and the sampler, whose read of the tokens
    waits for the device)."""

    step: int
    saved: list[int] = []
    loaded: list[int] = []
    failed: list[int] = []
    load_s: dict[str, float] = {}
    save_s: float = 0.0
    forward_s: float = 0.0
    forward_tokens: int = 0


class MultiMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """One metadata per child of a multi-connector (None: nothing for it);
    ``expect_sending[req_id]``: how many children hold that finished
    request's blocks until their saves are done."""

    children: list[object]
    expect_sending: dict[str, int] = {}


class MultiReport(msgspec.Struct, frozen=True, kw_only=True):
    children: list[object]
