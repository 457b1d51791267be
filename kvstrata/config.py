"""Engine configuration: one small msgspec Struct per component, gathered in
EngineConfig. Each component is handed its own section, never the root.

``EngineConfig.validate()`` checks every field at start and raises
ValueError naming the field (``"scheduler.max_num_seqs must be >= 1"``).
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec


class ModelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Which model to run. ``model`` is a local Hugging Face directory
    (config.json + safetensors); None builds the default seeded random model."""

    model: str | None = None
    tokenizer: str | None = None
    # Activations (and dense weights): float32, float16, bfloat16 or "auto":
    # bf16 on a GPU; on a CPU the faster of float32 and bfloat16 as measured
    # on the GGUF's linear layers at load (bf16 must win by 10 %); a Hugging
    # Face checkpoint's own torch_dtype.
    dtype: str = "float32"
    # A GGUF's linear layers: "packed" (their quantized blocks stay in memory,
    # matmuls dequantize on the fly: docs/quantization.md), "dequantize"
    # (every tensor dequantized to ``dtype`` at load: exact, ~4-7x the
    # memory), or "auto": packed on a CPU where our native kernels run
    # (x86-64 with AVX2 or AVX512_BF16 and a C compiler: exact at every dtype), else
    # only when ``dtype`` is "auto" or "bfloat16" (torch's int4 kernel rounds
    # to bf16); dequantize on CUDA (measured faster there: an 8B Q4_0 model
    # packed decodes at 0.91x its bf16 copy on an H200, docs/quantization.md).
    # Ignored for Hugging Face checkpoints.
    quantized_weights: str = "auto"
    # Packed weights re-laid for the GPU at load (docs/quantization.md, "A GPU
    # layout"): on CUDA (or a CPU under TRITON_INTERPRET=1) each packed Q8_0,
    # Q4_0, Q4_K or Q6_K weight's values become one 16-byte aligned run of
    # 32-bit words a row, its scales arrays of their own (the file's values,
    # unchanged; its blocks dropped), read by a GEMV with 128-bit loads for 1-8
    # tokens, and dequantized then multiplied for more. Off by default: no GPU
    # run has timed or verified it yet. Only with packed weights.
    gpu_quant_layout: bool = False
    max_model_len: int | None = None
    seed: int = 0
    # torch intra-op threads for the model step (torch.set_num_threads, which
    # is process-wide); None keeps torch's default. On small shared CPU hosts
    # 1 is often much faster than oversubscribing the cores.
    num_threads: int | None = None
    # CUDA graphs for decode-only steps (``kvstrata.worker.cuda_graphs``):
    # the forward is captured once per batch size in ``cuda_graph_sizes``
    # (None: 1, 2, 4, 8, then every 8 up to scheduler.max_num_seqs and
    # max_num_batched_tokens, at most 512) and a decode batch is padded to
    # the next captured size and replayed. None: on for CUDA (every family,
    # sliding-window ones included: the HF oracle is identical with graphs
    # on and off on an H200, tools/gpu_check.sh); always off on a CPU.
    cuda_graphs: bool | None = None
    cuda_graph_sizes: list[int] | None = None
    # Fused kernels in the decoder layer (RMSNorm with the residual add, RoPE
    # with the KV cache write, SiLU-and-mul). None: on for CUDA (the Triton
    # ones: the oracle is identical with them for every family on an H200)
    # and for a CPU where their C kernels load (kernels/fused_native.py); off
    # on a CPU under TRITON_INTERPRET=1 unless asked for. True: on (Triton on
    # CUDA and under TRITON_INTERPRET=1, else C on a CPU, else the torch
    # references); False: off.
    fused_kernels: bool | None = None
    # Decode attention split over the KV range (flash-decoding) on the Triton
    # path: fills the GPU at small batches (an H200, batch 1 at 2k context:
    # 5.9 us against 23.6 unsplit). None: on for CUDA (the oracle is identical
    # with it there); off elsewhere (a CPU runs its own decode kernel).
    split_decode: bool | None = None


class CacheConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The device KV cache: paging, prefix caching, hashing."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_mib: int = 512
    enable_prefix_caching: bool = True
    hash_algo: str = "sha256"
    kv_layout: str = "per_layer"
    cache_namespace: str | None = None
    random_hash_root: bool = False
    metrics_sample_rate: float = 0.01
    # KV events (kvstrata.kv.events): to the vLLM-compatible ZMQ publisher at
    # this endpoint (PUB; ``kv_events_replay_endpoint`` its replay ROUTER),
    # and, with ``enable_kv_events``, to the engine subprocess's own clients
    # (a fleet router subscribes over the engine's socket).
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_buffer_steps: int = 10_000  # batches kept for replay (both ways out)
    enable_kv_events: bool = False
    # The events' wire shape: "vllm" (today's vLLM: maps) or "vllm-legacy"
    # (vLLM's earlier positional arrays); with ``kv_events_int_hashes`` block
    # hashes are sent as their low 64 bits (an unsigned int, as vLLM's int
    # hashes), for consumers that decode ints. docs/kv_events.md.
    kv_events_format: str = "vllm"
    kv_events_int_hashes: bool = False


class SchedulerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Token budget and admission."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    # Caps one request's prefill chunk per step when others compete for the
    # budget (0: no cap); a request alone in the engine gets the whole budget.
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"  # "fcfs", "priority", or "cache-aware" (more cached tokens first, with aging)
    # cache-aware: a request passed over this many times, or waiting this
    # long, is served in arrival order before the others of its priority
    cache_aware_max_skips: int = 64
    cache_aware_max_wait_s: float = 30.0
    max_waiting_requests: int = 4096
    enable_chunked_prefill: bool = True
    # /health reports "stalled" (503) when work is queued and no step has
    # computed a token for this long.
    stall_timeout_s: float = 60.0
    # Schedule step N+1 while step N runs (placeholders for the tokens N will
    # sample). None: on when the model runs on a GPU (the step is then the
    # device's, and the loop's work hides behind it); off on a CPU, where the
    # step and the loop share the cores and the GIL and overlap measured no
    # gain (tools/bench_decode_modes.py). Off while speculative decoding or a
    # KV connector is on.
    async_scheduling: bool | None = None
    # With async scheduling: launch step N+1 before N's sampled tokens are
    # read back (N+1's decode inputs are read from N's tokens on the device;
    # the one host sync per step moves behind the next launch), so the
    # host's work on a step overlaps the device's work on the one before.
    # Steps with drafts, logprobs or a KV connector read back at once. None:
    # on for CUDA (the oracle is identical with it on an H200, where it gave
    # 1.13-1.41x output tok/s over async scheduling alone); off on a CPU (no
    # gain: the device is the host).
    pipelined_steps: bool | None = None


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding (``kvstrata.enginecore.spec_decode``). ``method``
    None: off; "ngram": prompt lookup (the last ``prompt_lookup_min`` ..
    ``prompt_lookup_max`` tokens found earlier in the request's context
    propose the ``num_speculative_tokens`` that followed them). Every
    draft is verified by the model in the next step: greedy output is
    unchanged, sampled output keeps its distribution. Two drafts by default:
    on a CPU each draft costs about as much as a token, and two keep the
    cost on text that does not repeat within noise
    (``tools/bench_decode_modes.py``)."""

    method: str | None = None
    num_speculative_tokens: int = 2
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4


class KVTransferConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The KV connector (``kvstrata.connector``): ``connector`` is a
    registered name ("offload", "multi", "noop") or a dotted path to a
    connector class; ``options`` are that connector's own (for "offload":
    the store's tiers, chunk size, save and load policy). ``role`` "both"
    saves and loads; "producer" (the prefill engine of a disaggregated pair)
    only saves; "consumer" (its decode engine) only loads."""

    connector: str = "offload"
    role: Literal["both", "producer", "consumer"] = "both"
    options: dict[str, Any] = msgspec.field(default_factory=dict)  # Any: TOML values, the connector's to decode

    def validate(self, prefix: str = "kv_transfer") -> None:
        if not isinstance(self.connector, str) or not self.connector:
            raise ValueError(f"{prefix}.connector must be a connector name or a dotted class path")
        if self.role not in ("both", "producer", "consumer"):
            raise ValueError(f"{prefix}.role must be one of ('both', 'producer', 'consumer'), got {self.role!r}")
        if not isinstance(self.options, dict):
            raise ValueError(f"{prefix}.options must be a table of options")


def check_device(device: object) -> None:
    """ValueError unless ``device`` is 'auto', 'cpu', 'cuda' or 'cuda:N'."""
    if device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", str(device)):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N' (GPU N), got {device!r}")


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything the engine needs at start.

    ``executor`` is "model" (run the model) or "null" (a benchmark executor
    that returns tokens at no cost, for measuring engine overhead).
    ``kv_transfer`` adds a KV connector (the tiered store); None: the device
    prefix cache alone.
    """

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig | None = None
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)
    device: str = "auto"
    executor: str = "model"
    log_level: str = "INFO"

    def validate(self) -> None:
        c, s = self.cache, self.scheduler
        _positive("cache.block_size", c.block_size)
        if c.num_blocks is not None:
            _positive("cache.num_blocks", c.num_blocks)
        _positive("cache.kv_cache_memory_mib", c.kv_cache_memory_mib)
        if not 0.0 <= c.metrics_sample_rate <= 1.0:
            raise ValueError("cache.metrics_sample_rate must be in [0, 1]")
        if c.kv_layout not in ("per_layer", "cross_layer"):
            raise ValueError(f"cache.kv_layout must be 'per_layer' or 'cross_layer', got {c.kv_layout!r}")
        if c.kv_events_format not in ("vllm", "vllm-legacy"):
            raise ValueError(f"cache.kv_events_format must be 'vllm' or 'vllm-legacy', got {c.kv_events_format!r}")
        if not isinstance(c.kv_events_int_hashes, bool):
            raise ValueError(f"cache.kv_events_int_hashes must be true or false, got {c.kv_events_int_hashes!r}")
        _positive("scheduler.max_num_batched_tokens", s.max_num_batched_tokens)
        _positive("scheduler.max_num_seqs", s.max_num_seqs)
        _positive("scheduler.max_waiting_requests", s.max_waiting_requests)
        if not s.stall_timeout_s > 0:
            raise ValueError(f"scheduler.stall_timeout_s must be > 0, got {s.stall_timeout_s}")
        if s.long_prefill_token_threshold < 0:
            raise ValueError("scheduler.long_prefill_token_threshold must be >= 0")
        if s.cache_aware_max_skips < 0 or not s.cache_aware_max_wait_s > 0:
            raise ValueError("scheduler.cache_aware_max_skips must be >= 0 and cache_aware_max_wait_s > 0")
        if s.policy not in ("fcfs", "priority", "cache-aware"):
            raise ValueError(f"scheduler.policy must be 'fcfs', 'priority' or 'cache-aware', got {s.policy!r}")
        if self.model.dtype not in ("float32", "float16", "bfloat16", "auto"):
            raise ValueError(f"model.dtype must be float32, float16, bfloat16 or auto, got {self.model.dtype!r}")
        if self.model.quantized_weights not in ("auto", "packed", "dequantize"):
            raise ValueError("model.quantized_weights must be 'auto', 'packed' or 'dequantize', "
                             f"got {self.model.quantized_weights!r}")
        if not isinstance(self.model.gpu_quant_layout, bool):
            raise ValueError(f"model.gpu_quant_layout must be true or false, got {self.model.gpu_quant_layout!r}")
        if self.model.max_model_len is not None:
            _positive("model.max_model_len", self.model.max_model_len)
        if self.model.num_threads is not None:
            _positive("model.num_threads", self.model.num_threads)
        sizes = self.model.cuda_graph_sizes
        if sizes is not None:
            if not isinstance(sizes, list) or not sizes:
                raise ValueError("model.cuda_graph_sizes must be a non-empty list of batch sizes")
            for n in sizes:
                _positive("model.cuda_graph_sizes[]", n)
        check_device(self.device)
        sp = self.speculative
        if sp.method not in (None, "ngram"):
            raise ValueError(f"speculative.method must be 'ngram' or unset, got {sp.method!r}")
        if sp.method is not None:
            _positive("speculative.num_speculative_tokens", sp.num_speculative_tokens)
            _positive("speculative.prompt_lookup_min", sp.prompt_lookup_min)
            if sp.prompt_lookup_max < sp.prompt_lookup_min:
                raise ValueError(f"speculative.prompt_lookup_max ({sp.prompt_lookup_max}) must be >= "
                                 f"prompt_lookup_min ({sp.prompt_lookup_min})")
        if self.kv_transfer is not None:
            if not isinstance(self.kv_transfer, KVTransferConfig):
                raise ValueError("kv_transfer must be a KVTransferConfig table")
            self.kv_transfer.validate()
        if self.executor not in ("model", "null"):
            raise ValueError(f"executor must be 'model' or 'null', got {self.executor!r}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
