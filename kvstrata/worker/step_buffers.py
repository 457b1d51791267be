"""The packed buffer a step's index tensors live in, and where each sits.

One int32 buffer holds every index tensor the forward reads (token ids,
positions, query starts, sequence lengths, slot mappings and block tables
per KV cache group) and, last, the logits rows. It is persistent on the
device (captured CUDA graphs hold its addresses); on CUDA a step fills one
of two pinned host buffers and copies the used prefix with one
non-blocking copy. ``InputBatch`` (``input_batch.py``) fills it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from kvstrata.worker.model.attention import AttentionMetadata


@dataclass(slots=True, frozen=True)
class StepLayout:
    """Where each index tensor of a step sits in the packed int32 buffer.

    The forward's inputs come first, in an order whose offsets depend only
    on (tokens, sequences, table width, groups): a CUDA graph captured for
    batch size n reads the same addresses at every replay of size n. The
    logits rows (read after the forward, outside any graph) come last.
    The offsets are computed once, at construction (``step_layout`` keeps
    the layouts of recent shapes).
    """

    num_tokens: int
    num_seqs: int
    width: int  # block-table columns
    num_groups: int
    num_logits: int
    ids: int = field(init=False, repr=False, compare=False)
    positions: int = field(init=False, repr=False, compare=False)
    qsl: int = field(init=False, repr=False, compare=False)
    seq_lens: int = field(init=False, repr=False, compare=False)
    logits: int = field(init=False, repr=False, compare=False)
    size: int = field(init=False, repr=False, compare=False)
    _slots: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _tables: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        t, n, g = self.num_tokens, self.num_seqs, self.num_groups
        put = object.__setattr__  # frozen: set once, here
        put(self, "ids", 0)
        put(self, "positions", t)
        put(self, "qsl", 2 * t)
        put(self, "seq_lens", 2 * t + n + 1)
        slots = tuple(2 * t + 2 * n + 1 + i * t for i in range(g + 1))
        tables = tuple(slots[g] + i * n * self.width for i in range(g + 1))
        put(self, "_slots", slots)
        put(self, "_tables", tables)
        put(self, "logits", tables[g])
        put(self, "size", tables[g] + self.num_logits)

    def slots(self, g: int) -> int:
        return self._slots[g]

    def table(self, g: int) -> int:
        return self._tables[g]


@functools.lru_cache(maxsize=1024)
def step_layout(num_tokens: int, num_seqs: int, width: int, num_groups: int, num_logits: int) -> StepLayout:
    """The layout of a step of this shape (shapes repeat: decode steps of one batch size)."""
    return StepLayout(num_tokens, num_seqs, width, num_groups, num_logits)


def layout_capacity(max_tokens: int, max_seqs: int, max_blocks: int, num_groups: int) -> int:
    """Elements of the packed buffer for any step within these bounds (drafts
    give up to one logits row per token)."""
    return StepLayout(max_tokens, max_seqs, max_blocks, num_groups, max_tokens).size


class StepBuffers:
    """Owns: the packed int32 buffer the forward reads its index tensors from
    (persistent on the device: captured CUDA graphs hold its addresses) and,
    on CUDA, two pinned host staging buffers filled in turn.

    A step fills a host buffer through numpy views, then ``commit`` copies
    the used prefix to the device with one non-blocking copy and records an
    event; the next time that host buffer's turn comes, its event is waited
    for (already passed in practice: the step between sampled, which syncs).
    On a CPU the host buffer is the device buffer: nothing is copied.
    """

    __slots__ = ("device", "capacity", "device_buf", "_host", "_host_np", "_events", "_turn")

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        self.capacity = capacity
        if device.type == "cpu":
            self.device_buf = torch.zeros(capacity, dtype=torch.int32)
            self._host = [self.device_buf]
        else:
            self.device_buf = torch.zeros(capacity, dtype=torch.int32, device=device)
            self._host = [torch.zeros(capacity, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._host_np = [h.numpy() for h in self._host]
        self._events: list[torch.cuda.Event | None] = [None] * len(self._host)
        self._turn = 0

    def begin(self) -> np.ndarray:
        """The host buffer to fill for the next step (numpy view)."""
        self._turn = (self._turn + 1) % len(self._host)
        event = self._events[self._turn]
        if event is not None and not event.query():  # a poll; a wait only if the GPU lags two steps
            event.synchronize()
        return self._host_np[self._turn]

    def commit(self, used: int) -> torch.Tensor:
        """Make the first ``used`` elements visible on the device; returns the device buffer."""
        if self.device.type != "cpu":
            self.device_buf[:used].copy_(self._host[self._turn][:used], non_blocking=True)
            event = self._events[self._turn] or torch.cuda.Event()
            event.record()
            self._events[self._turn] = event
        return self.device_buf


class StepViews:
    """The tensors a step of one layout reads: views of the device buffer.
    Attention metadata is made anew per step (it keeps one step's plans),
    around the same views."""

    __slots__ = ("input_ids", "positions", "logits_indices", "_groups")

    def __init__(self, d: torch.Tensor, lay: StepLayout) -> None:
        t, n, w = lay.num_tokens, lay.num_seqs, lay.width
        self.input_ids = d[lay.ids:lay.ids + t]
        self.positions = d[lay.positions:lay.positions + t]
        self.logits_indices = d[lay.logits:lay.logits + lay.num_logits]
        qsl, seq_lens = d[lay.qsl:lay.qsl + n + 1], d[lay.seq_lens:lay.seq_lens + n]
        self._groups = [(d[lay.slots(g):lay.slots(g) + t], d[lay.table(g):lay.table(g) + n * w].view(n, w), qsl,
                         seq_lens) for g in range(lay.num_groups)]

    def metadata(self, layer_groups: list[int] | None) -> AttentionMetadata | list[AttentionMetadata]:
        """One AttentionMetadata, or one per layer (its KV cache group's)."""
        metas = [AttentionMetadata(slot_mapping=s, block_tables=b, query_start_loc=q, seq_lens=n)
                 for s, b, q, n in self._groups]
        if len(metas) == 1:
            return metas[0]
        assert layer_groups is not None
        return [metas[g] for g in layer_groups]
