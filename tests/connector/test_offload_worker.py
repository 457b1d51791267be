"""The offload worker side on CPU: bulk and layer-by-layer transfers between
lent host buffers and the paged cache, in both cache layouts, and failures
reported per chunk."""

from __future__ import annotations

import pytest
import torch

from kvstrata.kernels import KVCacheShape, allocate_kv_caches
from kvstrata.kv import CacheIdentity
from kvstrata.connector import ChunkTransfer, ConnectorSpec, OffloadMetadata, RequestTransfer
from kvstrata.connector.metadata import BlendLoad
from kvstrata.connector.offload import OffloadWorker

L, NB, BS, H, D = 3, 12, 4, 2, 8


def spec() -> ConnectorSpec:
    ident = CacheIdentity(model_fingerprint="m", kv_dtype="float32", kv_layout="per_layer", block_size=BS)
    return ConnectorSpec(identity=ident, num_layers=L, num_kv_heads=H, head_size=D, dtype="float32",
                         max_model_len=64)


def make(layout: str, batched: bool | None = None, seed: int = 0, staged: bool = False):
    backing, caches = allocate_kv_caches(KVCacheShape(num_layers=L, num_blocks=NB, block_size=BS, num_kv_heads=H,
                                                      head_size=D), layout, torch.float32, "cpu")
    backing.copy_(torch.randn(backing.shape, generator=torch.Generator().manual_seed(seed)))
    buffers: dict[int, torch.Tensor] = {}
    worker = OffloadWorker(spec(), buffers, batched_layer_transfers=batched, staged_layer_transfers=staged)
    worker.register_kv_caches(caches, "cpu")
    return backing, caches, buffers, worker


def block(caches, layer: int, b: int) -> torch.Tensor:
    k, v = caches[layer]
    return torch.stack([k[b], v[b]])


def run_step(worker, meta, num_layers=L):
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    for i in range(num_layers):
        worker.wait_for_layer_load(i)
        worker.save_kv_layer(i)
    worker.wait_for_save()
    result = worker.get_finished([]), worker.get_block_ids_with_load_errors(), worker.take_report()
    worker.clear_connector_metadata()
    return result


@pytest.mark.parametrize("layout", ["per_layer", "cross_layer"])
def test_bulk_save_then_bulk_load_into_other_blocks(layout):
    _, caches, buffers, worker = make(layout)
    buffers[1] = torch.zeros(L, 2, 8, H, D)
    save = OffloadMetadata(step=1, bulk_saves=[RequestTransfer("a", [ChunkTransfer(1, [3, 7], 0, 8)])],
                           finishing=["a"])
    (sending, recving), invalid, report = run_step(worker, save)
    assert (sending, recving, invalid) == ({"a"}, set(), set())
    assert report.saved == [1] and report.failed == []
    load = OffloadMetadata(step=2, bulk_loads=[RequestTransfer("b", [ChunkTransfer(1, [5, 9], 0, 8)])])
    (sending, recving), invalid, report = run_step(worker, load)
    assert (sending, recving, invalid) == (set(), {"b"}, set())
    assert report.loaded == [1] and set(report.load_s) == {"b"}
    for layer in range(L):
        assert torch.equal(block(caches, layer, 5), block(caches, layer, 3))
        assert torch.equal(block(caches, layer, 9), block(caches, layer, 7))


def test_layer_load_writes_only_its_token_range():
    backing, caches, buffers, worker = make("per_layer")
    before = backing.clone()
    buffers[4] = torch.randn(L, 2, 8, H, D)
    meta = OffloadMetadata(step=1, layer_loads=[RequestTransfer("a", [ChunkTransfer(4, [2, 6], 3, 7)])])
    _, invalid, report = run_step(worker, meta)
    assert invalid == set() and report.loaded == [4]
    for layer in range(L):
        k, v = caches[layer]
        tok = torch.cat([k[2], k[6]])  # the 8 token positions of the chunk, K only
        assert torch.equal(tok[3:7], buffers[4][layer, 0, 3:7])
        assert torch.equal(tok[:3], torch.cat([before[layer, 0, 2], before[layer, 0, 6]])[:3])
        assert torch.equal(tok[7:], torch.cat([before[layer, 0, 2], before[layer, 0, 6]])[7:])
        assert torch.equal(torch.cat([v[2], v[6]])[3:7], buffers[4][layer, 1, 3:7])
    untouched = [b for b in range(NB) if b not in (2, 6)]
    assert torch.equal(backing[:, :, untouched], before[:, :, untouched])


def test_layer_saves_gather_each_layer_after_it_is_computed():
    _, caches, buffers, worker = make("cross_layer")
    buffers[2] = torch.zeros(L, 2, 4, H, D)
    meta = OffloadMetadata(step=1, layer_saves=[RequestTransfer("a", [ChunkTransfer(2, [8], 0, 4)])], num_tokens=40)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    for i in range(L):
        worker.wait_for_layer_load(i)
        k, v = caches[i]
        k[8].fill_(i + 1.0)  # "layer i's attention" writes the block, then the hook saves it
        worker.save_kv_layer(i)
    worker.wait_for_save()
    report = worker.take_report()
    worker.clear_connector_metadata()
    assert report.saved == [2] and report.forward_tokens == 40
    assert [buffers[2][i, 0].unique().tolist() for i in range(L)] == [[1.0], [2.0], [3.0]]


def test_a_failed_load_reports_its_blocks_and_a_failed_save_is_dropped():
    _, _, buffers, worker = make("per_layer")
    buffers[1] = torch.zeros(L, 2, 8, H, 2 * D)  # wrong head size: the copy raises
    buffers[2] = torch.zeros(L, 2, 8, H, 2 * D)
    meta = OffloadMetadata(step=1, bulk_loads=[RequestTransfer("a", [ChunkTransfer(1, [1, 2], 0, 8)], [10, 11])],
                           bulk_saves=[RequestTransfer("b", [ChunkTransfer(2, [3, 4], 0, 8)])])
    (sending, recving), invalid, report = run_step(worker, meta)
    assert recving == {"a"} and invalid == {1, 2, 10, 11}
    assert report.failed == [1, 2] and report.saved == [] and report.loaded == []


def _mixed_step(buffers) -> OffloadMetadata:
    """Layer loads of three chunks (two of 8 tokens, one of 4: a request's
    short last chunk), and layer saves of two chunks, in one step."""
    g = torch.Generator().manual_seed(3)
    for h, n in ((1, 8), (2, 8), (3, 4)):
        buffers[h] = torch.randn((L, 2, n, H, D), generator=g)
    for h, n in ((4, 8), (5, 4)):
        buffers[h] = torch.zeros((L, 2, n, H, D))
    return OffloadMetadata(
        step=1,
        layer_loads=[RequestTransfer("a", [ChunkTransfer(1, [0, 1], 0, 8), ChunkTransfer(3, [4], 0, 3)]),
                     RequestTransfer("b", [ChunkTransfer(2, [2, 3], 2, 8)])],
        layer_saves=[RequestTransfer("c", [ChunkTransfer(4, [6, 7], 0, 8), ChunkTransfer(5, [8], 1, 4)])])


@pytest.mark.parametrize("layout", ["per_layer", "cross_layer"])
def test_batched_layer_transfers_equal_the_per_chunk_ones(layout):
    """One call per layer and chunk length moves exactly what one call per
    chunk and layer moves, for loads and saves, partial chunks included;
    so do staged layer loads (each batch's chunks stacked once, each layer
    scattered from there)."""
    results = []
    for batched, staged in ((False, False), (True, False), (True, True)):
        backing, _, buffers, worker = make(layout, batched, staged=staged)
        assert worker.batched is batched
        _, invalid, report = run_step(worker, _mixed_step(buffers))
        assert invalid == set() and report.failed == []
        assert sorted(report.loaded) == [1, 2, 3] and sorted(report.saved) == [4, 5]
        results.append((backing, buffers[4], buffers[5]))
    for per_chunk, batched, staged in zip(*results, strict=True):
        assert torch.equal(per_chunk, batched) and torch.equal(per_chunk, staged)
    assert make("per_layer")[3].batched  # None: on


def test_batched_layer_transfers_default_on_for_a_cuda_cache_too(monkeypatch):
    """The default (None) batches on CUDA too (an H200 run: 7x less host time
    than per chunk, the CUDA tier oracle identical); False keeps per chunk."""
    from kvstrata.connector.offload import worker as worker_module

    class CudaStreams:  # what register_kv_caches builds for a CUDA cache (a CPU cannot make CUDA streams)
        is_cuda = True

        def __init__(self, device, num_layers) -> None:
            pass

    monkeypatch.setattr(worker_module, "KVStreams", CudaStreams)
    caches = make("per_layer")[1]
    for option, want in ((None, True), (False, False), (True, True)):
        worker = OffloadWorker(spec(), {}, batched_layer_transfers=option)
        worker.register_kv_caches(caches, "cuda")
        assert worker.batched is want


def _bulk_step(buffers) -> OffloadMetadata:
    """Bulk loads of two requests (one with a short last chunk) and bulk
    saves of three chunks of two requests, in one step."""
    g = torch.Generator().manual_seed(4)
    for h, n in ((1, 8), (2, 8), (3, 4)):
        buffers[h] = torch.randn((L, 2, n, H, D), generator=g)
    for h, n in ((4, 8), (5, 4), (6, 8)):
        buffers[h] = torch.zeros((L, 2, n, H, D))
    return OffloadMetadata(
        step=1,
        bulk_loads=[RequestTransfer("a", [ChunkTransfer(1, [0, 1], 0, 8), ChunkTransfer(3, [4], 0, 3)]),
                    RequestTransfer("b", [ChunkTransfer(2, [2, 3], 1, 8)])],
        bulk_saves=[RequestTransfer("c", [ChunkTransfer(4, [6, 7], 0, 8), ChunkTransfer(5, [8], 0, 4)]),
                    RequestTransfer("d", [ChunkTransfer(6, [9, 10], 2, 8)])],
        finishing=["c", "d"])


@pytest.mark.parametrize("layout", ["per_layer", "cross_layer"])
def test_batched_bulk_transfers_equal_the_per_chunk_ones(layout):
    results = []
    for batched in (False, True):
        backing, _, buffers, worker = make(layout, batched)
        (sending, recving), invalid, report = run_step(worker, _bulk_step(buffers))
        assert (sending, recving, invalid) == ({"c", "d"}, {"a", "b"}, set()) and report.failed == []
        assert sorted(report.loaded) == [1, 2, 3] and sorted(report.saved) == [4, 5, 6]
        results.append((backing, buffers[4], buffers[5], buffers[6]))
    for per_chunk, batched in zip(*results, strict=True):
        assert torch.equal(per_chunk, batched)


@pytest.mark.parametrize("staged", [False, True], ids=["per_layer_calls", "staged"])
@pytest.mark.parametrize(("bad", "failed", "loaded", "saved", "invalid"), [
    (2, [1, 2], [3], [4, 5], {0, 1, 2, 3}),  # the 8-token loads' batch: their blocks reported
    (4, [4], [1, 2, 3], [5], set()),  # the 8-token saves' batch: dropped, no load fails
], ids=["load_batch", "save_batch"])
def test_a_failed_batch_fails_every_chunk_in_it(staged, bad, failed, loaded, saved, invalid):
    _, _, buffers, worker = make("per_layer", batched=True, staged=staged)
    meta = _mixed_step(buffers)
    buffers[bad] = torch.zeros(L, 2, 8, H, 2 * D)  # wrong head size: its batch raises
    _, got_invalid, report = run_step(worker, meta)
    assert sorted(report.failed) == failed
    assert sorted(report.loaded) == loaded and sorted(report.saved) == saved
    assert got_invalid == invalid


def test_no_metadata_no_work():
    _, _, _, worker = make("per_layer")
    (sending, recving), invalid, report = run_step(worker, None)
    assert (sending, recving, invalid, report) == (set(), set(), set(), None)


class _StreamCalls:
    """The worker's real (CPU) KVStreams, recording the calls named in order:
    the stream ordering a CUDA run depends on, which a CPU run cannot show."""

    def __init__(self, streams, names: tuple[str, ...]) -> None:
        self._streams = streams
        self._names = names
        self.calls: list[tuple[str, object]] = []

    def __getattr__(self, name: str):
        real = getattr(self._streams, name)
        if name not in self._names:
            return real

        def spy(*args, **kw):
            out = real(*args, **kw)
            self.calls.append((name, args[0] if name == "wait_loaded" else out))
            return out

        return spy


def test_a_blend_is_waited_for_before_the_forward_and_ahead_of_bulk_loads():
    """A blend request computes in its own step: the compute stream must wait
    for the blend's write (no layer load may be there to wait for), and only
    for it, so blends go to the load stream before the step's bulk loads."""
    _, caches, buffers, worker = make("per_layer")
    buffers[1] = torch.randn(L, 2, 8, H, D)
    kv = torch.randn(L, 2, 8, H, D)
    worker.set_blender(lambda tokens, segments, cached, ratio: (kv[:, :, :len(tokens)], [None]))
    worker.streams = spy = _StreamCalls(worker.streams, ("load_all", "load_all_segments", "wait_loaded",
                                                         "wait_layer_loaded"))
    meta = OffloadMetadata(step=1, blend_loads=[BlendLoad("a", list(range(8)), [(0, 8)], [-1], [-1], [3, 4], 0.0)],
                           bulk_loads=[RequestTransfer("b", [ChunkTransfer(1, [5, 9], 0, 8)])])
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    assert not worker.loads_layer_by_layer()  # so no per-layer wait would cover the blend
    names = [name for name, _ in spy.calls]
    assert names == ["load_all", "wait_loaded", "load_all_segments"]
    assert spy.calls[1][1] is spy.calls[0][1]  # the blend's own transfer
    worker.wait_for_save()
    worker.clear_connector_metadata()
    for layer in range(L):
        assert torch.equal(torch.cat([block(caches, layer, 3), block(caches, layer, 4)], dim=1), kv[layer])


def test_a_step_that_fails_before_wait_for_save_waits_for_its_transfers():
    """The loop hands a failed step's lent buffers and blocks back as soon as
    it hears of the failure: the worker must first wait for the copies the
    step queued (clear_connector_metadata, from the runner's finally)."""
    _, _, buffers, worker = make("per_layer")
    buffers[1] = torch.zeros(L, 2, 8, H, D)
    worker.streams = spy = _StreamCalls(worker.streams, ("synchronize",))
    meta = OffloadMetadata(step=1, layer_saves=[RequestTransfer("a", [ChunkTransfer(1, [3, 7], 0, 8)])])
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    worker.save_kv_layer(0)  # the forward raises after this layer
    worker.clear_connector_metadata()
    assert [name for name, _ in spy.calls] == ["synchronize"]
    run_step(worker, meta)  # a step that reached wait_for_save is not waited for again when cleared
    assert [name for name, _ in spy.calls] == ["synchronize"]


def test_staged_layer_transfers_stage_each_batch_once_and_move_each_layer_through_it(monkeypatch):
    """With ``staged_layer_transfers`` the host chunks of a batch are checked
    and staged once per step, and every layer is one scatter from (loads) or
    one gather into (saves) the staging: no call per chunk and layer."""
    from kvstrata.kernels import KVStreams

    calls = dict.fromkeys(("stage_loads", "load_staged_layer", "stage_saves", "store_staged_layer",
                           "load_layer_segments", "store_layer_segments"), 0)
    for name in calls:
        def counted(self, *args, _f=getattr(KVStreams, name), _k=name, **kwargs):
            calls[_k] += 1
            return _f(self, *args, **kwargs)
        monkeypatch.setattr(KVStreams, name, counted)
    backing, _, buffers, worker = make("per_layer", True, staged=True)
    _, invalid, report = run_step(worker, _mixed_step(buffers))
    assert invalid == set() and sorted(report.loaded) == [1, 2, 3] and sorted(report.saved) == [4, 5]
    # two load batches (chunks of 8 and of 3 tokens), two save batches (8 and 4): staged once each,
    # moved once each per layer
    assert calls == {"stage_loads": 2, "load_staged_layer": 2 * L, "stage_saves": 2, "store_staged_layer": 2 * L,
                     "load_layer_segments": 0, "store_layer_segments": 0}


def test_staged_chunks_are_copied_a_run_of_layers_at_a_time():
    """On CUDA the staging is filled by ``StagedChunks.copy_in``: one copy per chunk
    and group of layers, a group when its first layer (or the layer before
    it) is loaded. The groups split the layers in order, evenly."""
    from kvstrata.kernels.staging import StagedChunks, layer_groups

    assert layer_groups(22, 2) == [range(0, 11), range(11, 22)]
    assert layer_groups(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert layer_groups(3, 64) == [range(0, 1), range(1, 2), range(2, 3)]  # at most one a layer
    assert layer_groups(4, 0) == [range(0, 4)]
    for num_layers in range(1, 30):
        for num_groups in range(1, 40):
            groups = layer_groups(num_layers, num_groups)
            assert [i for g in groups for i in g] == list(range(num_layers))
            assert max(map(len, groups)) - min(map(len, groups)) <= 1
    chunks = [torch.randn(5, 2, 4, H, D, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    staged = StagedChunks(chunks, torch.zeros(3, 5, 2, 4, H, D), layer_groups(5, 3))
    staged.num_copied = 0  # as on CUDA: nothing copied at staging
    staged.copy_in(1)
    assert torch.equal(staged.staging[:, :2], torch.stack(chunks)[:, :2])
    assert not staged.staging[:, 2:].any()
    staged.copy_in(3)
    assert staged.num_copied == 3 and torch.equal(staged.staging, torch.stack(chunks))
    assert staged.group_of(0) == 0 and staged.group_of(3) == 1 and staged.group_of(4) == 2


def test_staged_saves_go_out_a_group_at_a_time_and_in_layer_order():
    """A staged save gathers each layer into the staging and copies a group
    of layers out to the host chunks when its last layer is in; layers out
    of order (or twice) are refused: a group would go out incomplete."""
    from kvstrata.kernels import KernelArgumentError

    _, caches, _, worker = make("per_layer")
    streams = worker.streams
    outs = [torch.zeros(L, 2, 8, H, D) for _ in range(2)]
    slots = torch.arange(16) + 4
    staged = streams.stage_saves(outs, caches[0][0], 2)  # L = 3 layers: groups [0, 1], [2]
    assert staged.groups == [range(0, 2), range(2, 3)]
    streams.store_staged_layer(staged, 0, *caches[0], slots)
    assert not any(o.any() for o in outs) and staged.num_copied == 0  # group 0 not complete: nothing out yet
    with pytest.raises(KernelArgumentError, match="layers come in order"):
        streams.store_staged_layer(staged, 2, *caches[2], slots)
    streams.store_staged_layer(staged, 1, *caches[1], slots)
    assert staged.num_copied == 1 and not any(o[2].any() for o in outs)
    streams.store_staged_layer(staged, 2, *caches[2], slots)
    from kvstrata.kernels import gather_kv
    for s, out in enumerate(outs):
        assert torch.equal(out, gather_kv(caches, slots[8 * s:8 * (s + 1)]))
    with pytest.raises(KernelArgumentError, match="layers come in order"):
        streams.store_staged_layer(staged, 2, *caches[2], slots)


def test_staged_layer_transfers_need_batched_transfers():
    from kvstrata.connector.offload.options import OffloadOptions

    OffloadOptions(staged_layer_transfers=True).validate()
    with pytest.raises(ValueError, match="staged_layer_transfers needs batched_layer_transfers"):
        OffloadOptions(staged_layer_transfers=True, batched_layer_transfers=False).validate()
    with pytest.raises(ValueError, match="staged_layer_transfers must be true or false"):
        OffloadOptions(staged_layer_transfers=1).validate()
    assert OffloadOptions().staged_layer_transfers is False  # until a GPU run measures it
