"""The model runner: executes one ``SchedulerOutput`` on the model.

    SchedulerOutput ─► InputBatch (persistent: tokens, block tables per request)
                     ─► flat step inputs (token ids, positions, slot mapping,
                        block tables, query_start_loc, seq_lens)
                     ─► LlamaForCausalLM.forward (one varlen pass, every request)
                     ─► logits for the requests whose scheduled tokens reach
                        the end of their known tokens ─► Sampler
                     ─► ModelRunnerOutput

``execute_model`` is synchronous; the engine calls it from its worker
thread and never from the event loop. With a KV connector's worker side
attached (``set_kv_connector``) the forward pass runs layer by layer between
the connector's hooks (``start_load_kv``, ``wait_for_layer_load(i)``,
``save_kv_layer(i)``, ``wait_for_save``) and the output reports what the
connector finished; a step with only connector work (no tokens) still runs
the hooks. The runner keeps its own copy of each
request's tokens, appending what it samples, so the next decode step knows its
input token without the scheduler resending it.
"""

from __future__ import annotations

import time
from collections import deque

import msgspec
import structlog
import torch

from kvstrata.config import CacheConfig, ModelConfig, SchedulerConfig, check_device
from kvstrata.connector.base import KVConnectorWorker
from kvstrata.kernels import use_triton
from kvstrata.kernels.attention_native import attention_kernels
from kvstrata.kernels.dispatch import interpret_requested
from kvstrata.kernels.fused_native import fused_kernels
from kvstrata.kernels.quant_linear import token_class, token_class_counts
from kvstrata.worker.cuda_graphs import DecodeGraphs, graph_sizes
from kvstrata.worker.input_batch import InputBatch, SamplingMetadataCache, StepInputs
from kvstrata.worker.pending_step import Failed, Launched, PendingStep, Ready
from kvstrata.worker.model.config import LlamaArchConfig
from kvstrata.worker.model.default_model import default_model_dir
from kvstrata.worker.model.loader import load_checkpoint
from kvstrata.worker.model.llama import LlamaForCausalLM
from kvstrata.worker.sampler import Sampler
from kvstrata.worker.segment_blender import SegmentBlender
from kvstrata.text.tokenizer import load_tokenizer
from kvstrata.types import Logprobs, ModelRunnerOutput, SchedulerOutput
from kvstrata.kernels import KVCacheShape, allocate_kv_caches
from kvstrata.kv import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvstrata.kv.specs import group_layer_specs

log = structlog.get_logger(__name__)


def resolve_device(device: str) -> torch.device:
    check_device(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def layer_kv_specs(arch: LlamaArchConfig, dtype: str, block_size: int) -> dict[str, KVCacheSpec]:
    """The model's KV, per attention layer in layer order (the engine's
    builder groups equal specs into KV cache groups and sizes the pool from
    their page sizes). Full attention, or a sliding window per layer
    (Mistral: all; Qwen2 with use_sliding_window: some, two groups): blocks
    that leave the window are freed and hits follow the window's rules
    (``kvstrata.kv.managers.windowed``, the hybrid coordinator)."""
    kw = dict(block_size=block_size, num_kv_heads=arch.num_key_value_heads, head_size=arch.head_dim, dtype=dtype)
    windows = arch.layer_windows or (None,) * arch.num_hidden_layers
    return {f"model.layers.{i}.self_attn": (FullAttentionSpec(**kw) if w is None
                                            else SlidingWindowSpec(**kw, sliding_window=w))
            for i, w in enumerate(windows)}


def wants_cuda_graphs(setting: bool | None, device: torch.device) -> bool:
    """``model.cuda_graphs``: never on a CPU; None means on for CUDA, for
    every family (sliding-window ones too: an H200 run showed their graphs'
    tokens identical to eager steps and to HF)."""
    if device.type != "cuda":
        if setting:
            log.info("cuda_graphs_off", reason="CUDA graphs need a CUDA device", device=str(device))
        return False
    return True if setting is None else bool(setting)


def wants_fused_kernels(setting: bool | None, device: torch.device) -> bool:
    """``model.fused_kernels``: None turns them on for CUDA (Triton) and for
    a CPU where their C kernels load (``kernels/fused_native.py``), on a CPU
    not under TRITON_INTERPRET=1 (the interpreter would run the Triton ones);
    the oracle is identical with them on both, every family."""
    if setting is not None:
        return bool(setting)
    if device.type == "cuda":
        return True
    return device.type == "cpu" and not interpret_requested() and fused_kernels() is not None


def on_for_cuda(setting: bool | None, device: torch.device) -> bool:
    """A switch whose None means on for CUDA, off elsewhere (``model.split_decode``)."""
    return device.type == "cuda" if setting is None else bool(setting)


def check_max_model_len(requested: int | None, max_positions: int) -> int:
    if requested is None:
        return max_positions
    if requested > max_positions:
        raise ValueError(
            f"model.max_model_len ({requested}) exceeds the checkpoint's max_position_embeddings ({max_positions})"
        )
    return requested


def _without(so: SchedulerOutput, request_ids: frozenset[str]) -> SchedulerOutput:
    """``so`` computing nothing for ``request_ids`` (its batch bookkeeping, the
    new and cached request data, stays whole: the runner has applied it)."""
    scheduled = {r: n for r, n in so.num_scheduled_tokens.items() if r not in request_ids}
    drafts = {r: d for r, d in so.scheduled_spec_decode_tokens.items() if r not in request_ids}
    return msgspec.structs.replace(so, num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens=drafts,
                                   total_num_scheduled_tokens=sum(scheduled.values()))


def warm_up_shapes(max_num_tokens: int, max_num_seqs: int, max_model_len: int) -> list[list[int]]:
    """The steps ``ModelRunner.warm_up`` runs, as query lengths per sequence:
    a long prefill, an odd-length one, a mixed batch, and decode batches of
    1, 2, 3, 8, 16 and up to 64 sequences; those the limits allow. Then one
    prompt of each class of token count (``quant_linear.token_class_counts``:
    the packed GGUF matmul compiles each apart) that none of those steps
    has, up to the longest step: with few sequences a step of that many
    tokens is a prefill."""
    longest = min(max_num_tokens, max_model_len)
    decode = dict.fromkeys((1, 2, 3, 8, 16, min(max_num_seqs, 64)))
    shapes = [[longest], [max(1, longest // 2) + 1], [17, 1, 33], *([1] * n for n in decode)]
    shapes = [q for q in shapes if sum(q) <= max_num_tokens and len(q) <= max_num_seqs]
    warmed = {token_class(sum(q)) for q in shapes}
    for n in token_class_counts(longest):
        if token_class(n) not in warmed:
            shapes.append([n])
            warmed.add(token_class(n))
    return shapes


def warm_up_logits_rows(max_rows: int) -> list[int]:
    """The row counts ``ModelRunner.warm_up`` runs the LM head on: one of
    each class of token count up to ``max_rows``, the most rows a step
    samples (a row per sequence, and one per draft with speculative
    decoding). The head's N is the vocabulary, so its tiles compile apart
    from the layers'."""
    return token_class_counts(max_rows)


class ModelRunner:
    """Owns: the model weights, the paged KV cache tensors, the persistent
    batch (per-request tokens and block tables) and the sampler's generator."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device: str = "cpu",
                 scheduler_config: SchedulerConfig | None = None, *, max_drafts: int = 0) -> None:
        """``scheduler_config``: the step limits (tokens, sequences) the step
        buffers and decode graphs are sized for (default: the defaults).
        ``max_drafts``: the draft tokens a request may carry a step
        (speculative decoding), each one more row the step samples."""
        self.device = resolve_device(device)
        if self.device.type == "cuda" and self.device.index is not None:
            # cuda:N: this thread (the engine's step thread builds the runner
            # and runs every step) works on N: its events, current stream and
            # graph captures follow the current device, not the tensors'.
            torch.cuda.set_device(self.device)
        sched = scheduler_config or SchedulerConfig()
        if model_config.num_threads is not None:
            torch.set_num_threads(model_config.num_threads)
        path = model_config.model
        if path is None:
            path = str(default_model_dir(model_config.seed))
        ckpt = load_checkpoint(path, model_config.dtype, str(self.device), model_config.quantized_weights,
                               gpu_quant_layout=model_config.gpu_quant_layout)
        self.model = ckpt.model
        self.weight_bytes: int = ckpt.weight_bytes  # resident, as held (packed blocks stay packed)
        self.arch = ckpt.arch
        self.dtype = ckpt.dtype
        self.model_fingerprint: str = ckpt.fingerprint
        self.tokenizer = (load_tokenizer(model_config.tokenizer) if model_config.tokenizer
                          else load_tokenizer(str(ckpt.directory), gguf_metadata=ckpt.gguf_metadata))
        self.vocab_size: int = ckpt.arch.vocab_size
        self.max_model_len: int = check_max_model_len(model_config.max_model_len, ckpt.arch.max_position_embeddings)
        eos = [*self.tokenizer.eos_token_ids, *ckpt.arch.eos_token_ids]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(t for t in eos if t is not None))
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        self.sampling_metadata = SamplingMetadataCache(self.eos_token_ids, self.device)
        self.block_size = cache_config.block_size
        self.kv_layout = cache_config.kv_layout
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.kv_cache_backing: torch.Tensor | None = None
        self.kv_connector: KVConnectorWorker | None = None
        self.can_blend = False  # CacheBlend runs here: a Llama-family model under a connector that blends
        specs = self.kv_cache_spec()
        groups = group_layer_specs(specs)  # the engine's builder groups the same way
        group_of = {name: g for g, grp in enumerate(groups) for name in grp.layer_names}
        layer_groups = [group_of[name] for name in specs] if len(groups) > 1 else None
        self._layer_groups = layer_groups
        self._sched = sched
        self.batch = self._new_batch()
        self.max_logits_rows = min(sched.max_num_batched_tokens, sched.max_num_seqs * (1 + max_drafts))
        # a decode step of n sequences is n tokens: both limits bound a graph
        self.graph_sizes = graph_sizes(min(sched.max_num_seqs, sched.max_num_batched_tokens),
                                       model_config.cuda_graph_sizes)
        self.use_cuda_graphs = wants_cuda_graphs(model_config.cuda_graphs, self.device)
        self.fused_kernels = wants_fused_kernels(model_config.fused_kernels, self.device)
        self.split_decode = on_for_cuda(model_config.split_decode, self.device)
        self.native_layers = False  # the fused layers as direct kernel calls (on a CPU)
        if isinstance(self.model, LlamaForCausalLM):
            self.model.use_fused_kernels(self.fused_kernels)
            self.model.use_split_decode(self.split_decode)
            if self.fused_kernels and self.device.type == "cpu":
                why_not = self.model.use_native_layers(True)
                self.native_layers = why_not is None
                if why_not is not None:
                    log.info("native_layers_off", reason=why_not)
        if self.device.type == "cpu":
            attention_kernels()  # the CPU decode attention kernel: built (once per machine) and loaded now, not mid-step
        self.graphs: DecodeGraphs | None = None
        self._launched: deque[Launched] = deque()  # launched steps not yet collected, oldest first
        self._orphans: frozenset[str] = frozenset()  # requests of a launch that failed, for the next one
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(model_config.seed))
        if self.tokenizer.vocab_size > self.vocab_size:
            log.warning("tokenizer_vocab_exceeds_model", tokenizer=self.tokenizer.vocab_size, model=self.vocab_size)

    def kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """The KV spec of each attention layer, by layer name."""
        return layer_kv_specs(self.arch, self.dtype, self.block_size)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the zeroed paged cache for ``num_blocks`` blocks (block 0 is the null block)."""
        a = self.arch
        shape = KVCacheShape(
            num_layers=a.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_kv_heads=a.num_key_value_heads,
            head_size=a.head_dim,
        )
        try:
            self.kv_cache_backing, self.kv_caches = allocate_kv_caches(
                shape, self.kv_layout, self.model.dtype, self.device
            )
        except torch.OutOfMemoryError as e:
            raise torch.OutOfMemoryError(
                f"out of {self.device} memory allocating the KV cache ({num_blocks} blocks) after "
                f"{self.weight_bytes / 2**20:.0f} MiB of weights: lower cache.kv_cache_memory_mib "
                f"(or cache.num_blocks) ({e})") from e
        mib = self.kv_cache_backing.nbytes / 2**20
        log.info("kv_cache_allocated", num_blocks=num_blocks, layout=self.kv_layout, mib=round(mib, 1))
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches, self.device)
        # Warm-up activations (a step of max_num_batched_tokens) and the decode
        # graphs' pool come after the KV cache: an OOM there says what to lower.
        try:
            if use_triton("auto", self.device):
                self.warm_up()
            if self.use_cuda_graphs:
                self.capture_decode_graphs()
        except torch.OutOfMemoryError as e:
            self.kv_caches = self.kv_cache_backing = None  # this runner cannot serve: give the memory back
            raise torch.OutOfMemoryError(
                f"out of {self.device} memory warming up or capturing decode graphs after the KV cache took "
                f"{mib:.0f} MiB and the weights {self.weight_bytes / 2**20:.0f} MiB: lower "
                "cache.kv_cache_memory_mib, scheduler.max_num_batched_tokens or model.cuda_graph_sizes "
                f"(or set model.cuda_graphs = false) ({e})") from e

    def _new_batch(self) -> InputBatch:
        sched = self._sched
        return InputBatch(self.block_size, self.max_model_len, self.device, self._layer_groups,
                          max_num_tokens=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs)

    def limit_max_model_len(self, max_model_len: int) -> None:
        """The engine admits at most ``max_model_len`` tokens a request (its KV
        pool caps the checkpoint's context): block tables, the step buffers
        and the decode graphs' layouts are that wide, not the checkpoint's.
        Before ``initialize_kv_cache``."""
        if self.kv_caches is not None:
            raise RuntimeError("limit_max_model_len() must be called before initialize_kv_cache()")
        if max_model_len < self.max_model_len:
            self.max_model_len = max_model_len
            self.batch = self._new_batch()

    def warm_up(self) -> None:
        """Run the forward once on each kind of step shape with no real request
        (nothing written to the cache), and the LM head on each count of rows
        a step samples, so every Triton specialization is compiled at start
        and no request pays a compile (``warm_up_shapes``, ``warm_up_logits_rows``)."""
        t0 = time.perf_counter()
        b = self.batch
        shapes = warm_up_shapes(b.max_num_tokens, b.max_num_seqs, self.max_model_len)
        for q_lens in shapes:
            hidden = self._run_forward(b.dummy_inputs(q_lens))
        for rows in warm_up_logits_rows(self.max_logits_rows):
            self.model.compute_logits(hidden.new_zeros(rows, hidden.shape[-1]))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("model_warmed_up", seconds=round(time.perf_counter() - t0, 2), shapes=len(shapes))

    def capture_decode_graphs(self, sizes: list[int] | None = None, *, emulate: bool = False) -> DecodeGraphs:
        """Capture the decode forward for each batch size (``graph_sizes`` by
        default). ``emulate``: no capture, padded eager replays (tests, CPU)."""
        if self.kv_caches is None:
            raise RuntimeError("initialize_kv_cache() must be called before capturing graphs")
        if self.graphs is not None:
            self.graphs.release()
        limit = min(self.batch.max_num_seqs, self.batch.max_num_tokens)
        sizes = [n for n in (sizes or self.graph_sizes) if n <= limit]
        graphs = DecodeGraphs(self._run_forward, self.batch, sizes, emulate=emulate)
        graphs.capture()
        self.graphs = graphs
        return graphs

    def release_graphs(self) -> None:
        """Drop the decode graphs and their memory pool (the engine closed;
        the step thread, after its last step). Freed now, not whenever the
        collector reaches the closed engine: a pool freed in the middle of
        another engine's capture in this process would invalidate it."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def set_kv_connector(self, worker: KVConnectorWorker) -> None:
        """Attach a KV connector's worker side (``kvstrata.connector``): the
        forward pass then runs layer by layer with its load and save hooks."""
        self.kv_connector = worker
        if self.kv_caches is not None:
            worker.register_kv_caches(self.kv_caches, self.device)
        if isinstance(self.model, LlamaForCausalLM):
            self.can_blend = worker.set_blender(SegmentBlender(self.model))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Compute every scheduled token, sample for requests that reach their end."""
        if self.kv_caches is None:
            raise RuntimeError("initialize_kv_cache() must be called before execute_model()")
        self._settle()
        self._update_batch(scheduler_output)
        return self._execute(scheduler_output)

    # -- pipelined steps (kvstrata.worker.pending_step) ----------------------
    def launch(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Queue step ``scheduler_output`` on the device and return without
        reading its sampled tokens back; ``collect()`` returns the outputs in
        launch order. Never raises: a failure is ``collect()``'s to raise,
        and the launch after a failed one leaves the failed one's requests
        out (their tokens never come; the others run). A step that must read
        its tokens at once (a KV connector, drafts, logprobs) first lands
        every token in flight, then runs whole: its output is returned too
        (what its ``collect()`` will return), so the caller can hand it on
        before the next launch. Otherwise None."""
        orphans, self._orphans = self._orphans, frozenset()
        try:
            launched = self._launch(scheduler_output, orphans)
        except Exception as e:
            self._launched.append(Failed(e))
            # The step launched next (already scheduled behind this one) cannot
            # run these: their tokens from this step never come.
            self._orphans = frozenset(scheduler_output.num_scheduled_tokens)
            return None
        self._launched.append(launched)
        return launched.output if isinstance(launched, Ready) else None

    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest launched step (waits for its tokens)."""
        return self._launched.popleft().result()

    def _launch(self, so: SchedulerOutput, orphans: frozenset[str]) -> Launched:
        """``orphans``: requests of the launch before, which failed; they get
        nothing from this step (the scheduler fails them with that one), the
        others run as scheduled."""
        if self.kv_caches is None:
            raise RuntimeError("initialize_kv_cache() must be called before launch()")
        self._update_batch(so)
        if orphans and not orphans.isdisjoint(so.num_scheduled_tokens):
            so = _without(so, orphans)
        if self.kv_connector is None and not so.num_scheduled_tokens:
            return Ready(ModelRunnerOutput.empty())
        if not self._can_pipeline(so):
            self._settle()
            return Ready(self._execute(so))
        step = self.batch.prepare(so.num_scheduled_tokens)
        hidden = self._forward(step)
        self._advance(so.num_scheduled_tokens)
        if not step.sample_states:
            return Ready(ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=[[] for _ in step.req_ids]))
        logits = self.model.compute_logits(_logits_rows(hidden, step))
        tokens = self.sampler.sample(logits, self.sampling_metadata(step.sample_states))
        return PendingStep(step.req_ids, step.sample_states, step.sample_batch_idx, tokens)

    def _can_pipeline(self, so: SchedulerOutput) -> bool:
        """Whether ``so`` can leave its tokens on the device: it has tokens,
        no drafts, no connector, and no request asking for logprobs."""
        if self.kv_connector is not None or so.scheduled_spec_decode_tokens:
            return False
        batch = self.batch
        if not batch.num_with_logprobs:
            return True
        requests = batch.requests
        return all(requests[r].params.logprobs is None for r in so.num_scheduled_tokens)

    def _settle(self) -> None:
        """Land every token still in flight (their outputs wait in turn)."""
        for launched in self._launched:
            if isinstance(launched, PendingStep):
                try:
                    launched.result()
                except Exception:
                    pass  # raised again by collect(), in the step's turn

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The step over the updated batch, its tokens read back."""
        if self.kv_connector is not None:
            return self._execute_with_connector(scheduler_output, self.kv_connector)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput.empty()
        step = self.batch.prepare(scheduler_output.num_scheduled_tokens, scheduler_output.scheduled_spec_decode_tokens)
        return self._sample(scheduler_output, step, self._forward(step), ())

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """Hidden states of ``step``'s real rows: its captured graph replayed
        when there is one for it, else the eager forward."""
        graphs = self.graphs
        if graphs is not None and graphs.can_run(step):
            return graphs.run(step)
        return self._run_forward(step)[: step.num_tokens]

    def _advance(self, num_scheduled_tokens: dict[str, int]) -> None:
        """Count a step's scheduled tokens as computed in the runner's copy."""
        requests = self.batch.requests
        for req_id, n in num_scheduled_tokens.items():
            requests[req_id].num_computed_tokens += n

    def _run_forward(self, step: StepInputs) -> torch.Tensor:
        """The model's forward over ``step`` (every row, padding included)."""
        return self.model(step.input_ids, step.positions, step.meta, self.kv_caches)

    def _execute_with_connector(self, so: SchedulerOutput, conn: KVConnectorWorker) -> ModelRunnerOutput:
        """The step with the connector's hooks: loads before (and layer by layer
        within) the forward, saves after each layer; then what it finished.
        The sampler goes in before ``wait_for_save`` (on CUDA a sync of the
        transfer streams), so the device computes the logits while the host
        waits; the loads that failed are known by then (when their copies
        were issued), and their requests sample nothing."""
        conn.bind_connector_metadata(so.kv_connector_metadata)
        try:
            conn.start_load_kv()
            step = hidden = None
            if so.num_scheduled_tokens:
                step = self.batch.prepare(so.num_scheduled_tokens, so.scheduled_spec_decode_tokens)
                hidden = self._forward_layerwise(step, conn)
            invalid = conn.get_block_ids_with_load_errors()
            out = self._sample(so, step, hidden, invalid) if step is not None else ModelRunnerOutput.empty()
            conn.wait_for_save()
            sending, recving = conn.get_finished(so.finished_req_ids)
            report = conn.take_report()
        finally:
            conn.clear_connector_metadata()
        if not (sending or recving or invalid or report is not None):
            return out
        return msgspec.structs.replace(
            out, finished_sending=sorted(sending), finished_recving=sorted(recving),
            invalid_block_ids=sorted(invalid), kv_connector_stats=report,
        )

    def _forward_layerwise(self, step: StepInputs, conn: KVConnectorWorker) -> torch.Tensor:
        """The forward with the connector's hooks around each decoder layer:
        layer i's KV load is waited for before its attention reads the cache,
        and its KV is saved once its attention wrote it. A decode step with
        no layer-by-layer load replays its graph instead, then saves every
        layer (the saves read what the whole forward wrote)."""
        graphs = self.graphs
        if graphs is not None and graphs.can_run(step) and not conn.loads_layer_by_layer():
            hidden = graphs.run(step)
            for i in range(len(self.kv_caches)):
                conn.save_kv_layer(i)
            return hidden
        return self.model(step.input_ids, step.positions, step.meta, self.kv_caches, hooks=conn)[: step.num_tokens]

    def _sample(self, so: SchedulerOutput, step: StepInputs, hidden: torch.Tensor,
                invalid_blocks) -> ModelRunnerOutput:
        """Sample the requests that reached their last known token; a request
        whose loaded KV failed (``invalid_blocks``) samples nothing: the
        scheduler recomputes from its first failed block."""
        if step.sample_drafts is not None:
            return self._sample_with_drafts(so, step, hidden, invalid_blocks)
        sample_states, sample_idx = step.sample_states, step.sample_batch_idx
        keep: list[int] | None = None  # the sampled requests left when some loads failed
        if invalid_blocks and sample_states:
            keep = [i for i, st in enumerate(sample_states) if not self.batch.holds_any(st, invalid_blocks)]
            sample_states = [sample_states[i] for i in keep]
            sample_idx = [sample_idx[i] for i in keep]
        sampled_ids: list[list[int]] = [[] for _ in step.req_ids]
        logprobs_out: list[Logprobs | None] | None = None
        if sample_states:
            rows = _logits_rows(hidden, step) if keep is None else hidden.index_select(0, step.logits_indices[keep])
            logits = self.model.compute_logits(rows)
            meta = self.sampling_metadata(sample_states)
            tokens, logprobs = self.sampler(logits, meta)
            for state, b, token in zip(sample_states, sample_idx, tokens, strict=True):
                state.token_ids.append(token)
                sampled_ids[b] = [token]
            if logprobs is not None:
                logprobs_out = [None] * len(step.req_ids)
                for b, lp in zip(sample_idx, logprobs, strict=True):
                    logprobs_out[b] = lp
        self._advance(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=sampled_ids, logprobs=logprobs_out)

    def _sample_with_drafts(self, so: SchedulerOutput, step: StepInputs, hidden: torch.Tensor,
                            invalid_blocks) -> ModelRunnerOutput:
        """Verify drafts (``Sampler.verify_drafts``): each request gets the
        drafts kept plus one token; its computed count moves over the kept
        ones only (the scheduler does the same)."""
        rows: list[int] = []
        states: list = []
        groups: list[tuple[int, list[int] | None]] = []
        keep: list[int] = []
        all_idx = step.logits_rows if step.logits_rows is not None else step.logits_indices.tolist()
        pos = 0
        for i, (state, drafts) in enumerate(zip(step.sample_states, step.sample_drafts or [])):
            width = 1 + (len(drafts) if drafts else 0)
            if not (invalid_blocks and self.batch.holds_any(state, invalid_blocks)):
                keep.append(i)
                groups.append((len(rows), drafts))
                rows.extend(all_idx[pos:pos + width])
                states.extend([state] * width)
            pos += width
        sampled_ids: list[list[int]] = [[] for _ in step.req_ids]
        kept_of: dict[str, int] = {}
        if rows:
            idx = (step.logits_indices if len(keep) == len(step.sample_states)  # none dropped: the rows as built
                   else torch.tensor(rows, device=hidden.device))
            logits = self.model.compute_logits(hidden.index_select(0, idx))
            meta = self.sampling_metadata(states)
            results = self.sampler.verify_drafts(logits, meta, groups)
            for i, tokens in zip(keep, results, strict=True):
                state, b = step.sample_states[i], step.sample_batch_idx[i]
                state.token_ids.extend(tokens)
                sampled_ids[b] = tokens
                drafts = (step.sample_drafts or [])[i]
                if drafts:
                    kept_of[state.req_id] = len(tokens) - 1
        requests = self.batch.requests
        spec = so.scheduled_spec_decode_tokens
        for req_id, n in so.num_scheduled_tokens.items():
            drafts = spec.get(req_id)
            if drafts:
                n -= len(drafts) - kept_of.get(req_id, 0)
            requests[req_id].num_computed_tokens += n
        return ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=sampled_ids)

    def _update_batch(self, so: SchedulerOutput) -> None:
        batch = self.batch
        for req_id in so.finished_req_ids:
            batch.remove(req_id)
        for req_id in so.preempted_req_ids:
            batch.remove(req_id)
        for data in so.scheduled_new_reqs:
            batch.add(data)
        if so.scheduled_cached_reqs.req_ids:
            batch.update(so.scheduled_cached_reqs)


def _logits_rows(hidden: torch.Tensor, step: StepInputs) -> torch.Tensor:
    """The hidden states the step samples from: its logits rows, or ``hidden``
    itself (no gather kernel) when they are every row in order (a decode step
    where every request samples): logits rows rise strictly within
    [0, num_tokens), so as many of them as tokens are all of them."""
    if step.logits_rows is not None and len(step.logits_rows) == step.num_tokens:
        return hidden
    return hidden.index_select(0, step.logits_indices)
