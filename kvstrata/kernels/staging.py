"""A step's KV chunks staged whole on the device for layer-by-layer
transfers (``KVStreams.stage_loads`` / ``stage_saves``): the buffer, its
runs of layers (groups) and the host copies of a group in or out. The
streams decide when a copy is queued and on which stream."""

from __future__ import annotations

import torch


class StagedChunks:
    """S host chunks [L, 2, n, Hkv, D] (one n) moved layer by layer through
    one device buffer [S, L, 2, n, Hkv, D] (``KVStreams.stage_loads`` /
    ``stage_saves``), a run of layers (a group) per host copy: loads copy a
    group in ahead of its layers' scatters, saves gather each layer into the
    buffer and copy a group out once its last layer is in. One host copy per
    chunk and group instead of one per chunk and layer.

    Owns: the buffer (on a CPU a host tensor), the groups, how many of them
    are copied (loads: queued in; saves: queued out), and whether the side
    stream has waited for the compute stream yet (loads: once per staging)."""

    __slots__ = ("host_chunks", "staging", "groups", "num_copied", "waited")

    def __init__(self, host_chunks: list[torch.Tensor], staging: torch.Tensor, groups: list[range],
                 num_copied: int = 0) -> None:
        self.host_chunks = host_chunks
        self.staging = staging
        self.groups = groups
        self.num_copied = num_copied
        self.waited = False

    def group_of(self, layer: int) -> int:
        return next(g for g, layers in enumerate(self.groups) if layer in layers)

    def copy_in(self, upto: int) -> None:
        """Queue (on the current stream: the load stream) the host copies of
        layer groups [num_copied, upto) into the buffer: one non-blocking
        copy per chunk and group, earlier groups first."""
        for g in range(self.num_copied, upto):
            layers = self.groups[g]
            for s, chunk in enumerate(self.host_chunks):
                self.staging[s, layers.start:layers.stop].copy_(chunk[layers.start:layers.stop], non_blocking=True)
        self.num_copied = max(self.num_copied, upto)

    def copy_out(self, g: int) -> None:
        """Queue group ``g`` of the buffer out to the host chunks: one
        non-blocking copy per chunk (on the current stream)."""
        layers = self.groups[g]
        for s, chunk in enumerate(self.host_chunks):
            chunk[layers.start:layers.stop].copy_(self.staging[s, layers.start:layers.stop], non_blocking=True)
        self.num_copied = g + 1


def layer_groups(num_layers: int, num_groups: int) -> list[range]:
    """``num_layers`` layers in ``num_groups`` (at most one per layer) runs of
    consecutive layers, the first ones one layer longer where they differ."""
    num_groups = max(1, min(num_layers, num_groups))
    size, extra = divmod(num_layers, num_groups)
    groups, start = [], 0
    for g in range(num_groups):
        stop = start + size + (g < extra)
        groups.append(range(start, stop))
        start = stop
    return groups
