"""Options of the offload connector (``KVTransferConfig.options``)."""

from __future__ import annotations

from typing import Literal

import msgspec

from kvstrata.io.config import StoreConfig, check_float, check_int


class OffloadOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The offload connector over ``kvstrata.io``.

    ``chunk_size`` tokens per stored object (a multiple of the block size).
    Saves happen when a chunk fills during prefill, during decode when
    ``save_decode``, and for the chunks still unsaved when a request finishes
    (``save_on_finish``: its blocks are held until the save is done) or is
    preempted (``save_on_preempt``). ``load_mode``: "auto" loads chunks
    ready in CPU memory within the step (layer by layer), promotes chunks on
    local disk into CPU memory first (the request waits holding no blocks),
    and loads chunks on a remote tier asynchronously (blocks allocated, the
    request waits in WAITING_FOR_REMOTE_KVS); "async" loads everything
    asynchronously; "sync" promotes from every lower tier first.
    A lookup or load slower than its timeout counts as a miss (recompute).
    ``enable_events`` publishes BlockStored/BlockRemoved for every tier.
    ``max_prefetch``: how many arriving requests may have their chunks looked
    up or promoted before the scheduler reaches them (0: none).

    ``load_split`` decides, per request, how much of a hit that must be read
    from a lower tier is loaded and how much recomputed, the two overlapping
    (the front computed while the back loads, ``costs.py``): "cost" from the
    measured rates (prefill tokens/s, each tier's read bandwidth and
    latency), "load" loads it all, "compute" recomputes it all.
    ``load_split_fraction`` forces the share of the hit's chunks computed
    first (tests, benchmarks).

    ``batched_layer_transfers``: a step's layer-by-layer loads and saves of
    several chunks go as one ``KVStreams`` call per layer (one kernel launch;
    on CUDA one non-blocking host copy per chunk into a device staging
    buffer) instead of one call per chunk and layer. None: on (on an H200,
    12 chunks x 22 layers loaded in 9 ms instead of 64; the CUDA tier oracle
    is identical either way); False: per chunk.

    ``staged_layer_transfers`` (needs batched transfers): a batch of layer
    transfers goes through one device buffer of whole chunks per step, its
    host copies a run of layers at a time (``KVStreams.stage_loads`` /
    ``stage_saves``: about ``worker.STAGED_COPIES`` host copies a batch per
    step): loads scatter each layer from it, saves gather each layer into
    it. A step of S chunks then makes ~64 host copies instead of S per
    layer (26 chunks x 22 layers: 572, ~34 us of host time each on an
    H200). The buffer holds a step's chunks on the device while they move
    (bulk loads and saves already do: 26 chunks of 256 tokens of a
    TinyLlama-shaped bf16 model, ~150 MB). False (the default) until a GPU
    run times it: on a CPU the tokens are identical either way
    (tests/connector), on CUDA untimed.
    """

    store: StoreConfig = msgspec.field(default_factory=StoreConfig)
    chunk_size: int = 256
    save_decode: bool = False
    save_on_finish: bool = True
    save_on_preempt: bool = True
    load_mode: Literal["auto", "async", "sync"] = "auto"
    lookup_timeout_s: float = 5.0
    load_timeout_s: float = 10.0
    enable_events: bool = False
    max_prefetch: int = 8
    save_admission: Literal["all", "seen", "tinylfu"] = "tinylfu"
    admission_min_seen: int = 2
    admission_continuation: float = 0.5
    admission_capacity: int | None = None
    admission_sample_factor: int = 10
    load_split: Literal["cost", "load", "compute"] = "cost"
    load_split_fraction: float | None = None
    batched_layer_transfers: bool | None = None
    staged_layer_transfers: bool = False

    def validate(self, prefix: str = "kv_transfer.options") -> None:
        self.store.validate()
        check_int(f"{prefix}.chunk_size", self.chunk_size)
        check_int(f"{prefix}.max_prefetch", self.max_prefetch, 0)
        check_float(f"{prefix}.lookup_timeout_s", self.lookup_timeout_s)
        check_float(f"{prefix}.load_timeout_s", self.load_timeout_s)
        if self.load_split not in ("cost", "load", "compute"):
            raise ValueError(f"{prefix}.load_split must be 'cost', 'load' or 'compute', got {self.load_split!r}")
        if not isinstance(self.staged_layer_transfers, bool):
            raise ValueError(f"{prefix}.staged_layer_transfers must be true or false, "
                             f"got {self.staged_layer_transfers!r}")
        if self.staged_layer_transfers and self.batched_layer_transfers is False:
            raise ValueError(f"{prefix}.staged_layer_transfers needs batched_layer_transfers "
                             "(it stages a batch's chunks)")
        f = self.load_split_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0):
            raise ValueError(f"{prefix}.load_split_fraction must be a number in [0, 1], got {f!r}")
        if self.save_admission not in ("all", "seen", "tinylfu"):
            raise ValueError(f"{prefix}.save_admission must be 'all', 'seen' or 'tinylfu', got {self.save_admission!r}")
        check_int(f"{prefix}.admission_min_seen", self.admission_min_seen, 1)
        check_int(f"{prefix}.admission_sample_factor", self.admission_sample_factor)
        if self.admission_capacity is not None:
            check_int(f"{prefix}.admission_capacity", self.admission_capacity)
        if not isinstance(self.admission_continuation, (int, float)) or not 0.0 < self.admission_continuation <= 1.0:
            raise ValueError(f"{prefix}.admission_continuation must be in (0, 1], got {self.admission_continuation!r}")
        if self.load_mode not in ("auto", "async", "sync"):
            raise ValueError(f"{prefix}.load_mode must be 'auto', 'async' or 'sync', got {self.load_mode!r}")


