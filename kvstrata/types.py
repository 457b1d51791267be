"""Boundary objects of the engine core: sampling parameters, the scheduler's
output (what one model step must compute) and the model runner's output.

These are the contract between the scheduler (which owns requests and KV
state on the event loop) and the model runner (which executes a step off the
loop). They are frozen msgspec Structs of plain data: no tensors, no live
objects.

SchedulerOutput is a diff, in the manner of vLLM v1:

    step N   scheduled_new_reqs   = [A(full prompt, block ids)]
    step N+1 scheduled_cached_reqs = [A(new block ids only, num_computed_tokens)]

A request the runner has seen keeps its state in the runner's persistent
batch; the scheduler only sends what changed. A preempted request is named in
``preempted_req_ids`` (the runner drops its state); when it is scheduled again
it comes back in ``scheduled_new_reqs`` with all its tokens so far.
"""

from __future__ import annotations

from typing import Any, NewType

import msgspec

RequestId = NewType("RequestId", str)

_INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOTAL_CHARS = 16384
MAX_STOP_TOKEN_IDS = 1024
GREEDY_TEMPERATURE = 1e-5  # below it a request samples greedily (SamplingParams.greedy)


def _check_int(name: str, value: object, lo: int, *, note: str = "") -> None:
    """``value`` is an int (not a bool) in [lo, 2**63): what the wire carries."""
    if type(value) is not int or not lo <= value <= _INT64_MAX:
        low = "-2**63" if lo == -_INT64_MAX - 1 else str(lo)
        raise ValueError(f"{name} must be an integer in [{low}, 2**63){note}, got {value!r}")


DEFAULT_BLEND_RATIO = 0.3  # SmolLM2 RAG set (tools/bench_blend.py): KL 0.043 vs 0.087 at 0.15, 1.9x faster than a prefill
MAX_BLEND_SEGMENTS = 64


class BlendSpec(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """CacheBlend for one request: ``segments`` are ``[start, end)`` token
    spans of the prompt (sorted, not overlapping, before its last token)
    whose KV is reused from each segment's own stored KV wherever it sits
    (positions re-rotated), with ``recompute_ratio`` of their tokens
    recomputed (those whose KV deviates most from a full prefill) to restore
    attention across segments. 0: plain concatenation; 1: a full prefill."""

    segments: list[tuple[int, int]]
    recompute_ratio: float = DEFAULT_BLEND_RATIO

    def validate(self) -> None:
        r = self.recompute_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise ValueError(f"blend.recompute_ratio must be in [0, 1], got {r!r}")
        if not self.segments:
            raise ValueError("blend.segments must hold at least one segment")
        if len(self.segments) > MAX_BLEND_SEGMENTS:
            raise ValueError(f"blend.segments must hold at most {MAX_BLEND_SEGMENTS} segments, got {len(self.segments)}")
        prev = 0
        for i, span in enumerate(self.segments):
            start, end = span
            if type(start) is not int or type(end) is not int or not 0 <= start < end:
                raise ValueError(f"blend.segments[{i}] must be [start, end) with 0 <= start < end, got {list(span)}")
            if start < prev:
                raise ValueError(f"blend.segments[{i}] starts at {start}, before the previous one ends ({prev}): "
                                 "segments must be sorted and must not overlap")
            prev = end

    def check_prompt(self, num_tokens: int) -> None:
        """The spans fit a prompt of ``num_tokens`` (its last token is never a segment's)."""
        end = self.segments[-1][1]
        if end > num_tokens - 1:
            raise ValueError(f"blend.segments end at token {end}, but the prompt has {num_tokens} tokens "
                             "and its last token must come after every segment")


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """How to pick each next token and when to stop.

    ``top_k`` of -1 or 0 disables top-k; ``top_p`` of 1.0 and ``min_p`` of 0.0
    disable theirs. ``temperature`` 0 means greedy. ``logprobs`` asks for the
    log-probabilities of the sampled token and the top-n alternatives.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    stop: list[str] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # CacheBlend (non-prefix KV reuse) for this request; None: prefix reuse only.
    blend: BlendSpec | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range.

        Every integer must fit the wire (signed 64 bits), and the stop list is
        bounded (``MAX_STOP_STRINGS`` strings of at most ``MAX_STOP_STRING_CHARS``
        characters, ``MAX_STOP_TOTAL_CHARS`` in all; ``MAX_STOP_TOKEN_IDS``
        ids) so that one request cannot make stop matching expensive for all.
        """
        _check_int("max_tokens", self.max_tokens, 1)
        if self.blend is not None:
            self.blend.validate()
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, -1, note=" (-1 and 0 disable it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.seed is not None:
            _check_int("seed", self.seed, -_INT64_MAX - 1)
        if self.logprobs is not None and not (
            isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if any((type(t) is not int) or not 0 <= t <= _INT64_MAX for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be integers in [0, 2**63)")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any((not isinstance(s, str)) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}")
        total = sum(map(len, self.stop))
        if total > MAX_STOP_TOTAL_CHARS:
            raise ValueError(f"stop strings must total at most {MAX_STOP_TOTAL_CHARS} characters, got {total}")

    @property
    def greedy(self) -> bool:
        """Temperatures below ``GREEDY_TEMPERATURE`` sample greedily: dividing
        logits by one would overflow float32 (a tiny float64 may even round
        to 0 on the device), and the distribution is the argmax's anyway."""
        return self.temperature < GREEDY_TEMPERATURE


class NewRequestData(msgspec.Struct, frozen=True, kw_only=True):
    """A request the runner has not seen (or sees again after preemption).

    ``token_ids`` holds every known token (prompt, then outputs so far when
    resumed); ``num_prompt_tokens`` says where the prompt ends.
    ``block_ids`` has one list per KV cache group.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora_name: str | None = None


class CachedRequestData(msgspec.Struct, frozen=True, kw_only=True):
    """Deltas for requests the runner already holds, as parallel lists.

    ``new_block_ids[i]`` is None when request i got no new blocks this step,
    else one list per KV cache group, to append to its block table.
    ``num_computed_tokens[i]`` is the count before this step's tokens.
    """

    req_ids: list[str] = []
    new_block_ids: list[tuple[list[int], ...] | None] = []
    num_computed_tokens: list[int] = []

    @classmethod
    def empty(cls) -> "CachedRequestData":
        return cls()


class SchedulerOutput(msgspec.Struct, frozen=True, kw_only=True):
    """What one engine step computes.

    ``num_scheduled_tokens[req_id]`` tokens are computed for each scheduled
    request (a chunk of prompt, or one decode token), their sum is
    ``total_num_scheduled_tokens`` and never exceeds the token budget.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str] = []
    preempted_req_ids: list[str] = []
    kv_connector_metadata: Any = None  # Any: the connector's own metadata Struct (kvstrata.connector)
    # Draft tokens per request, computed after its next token and verified
    # (speculative decoding); counted in num_scheduled_tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class Logprobs(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """Log-probabilities at one position: the sampled token first, then the top-n."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int = 0


class ModelRunnerOutput(msgspec.Struct, frozen=True, kw_only=True):
    """Result of one step, indexed like ``req_ids``.

    ``sampled_token_ids[i]`` is empty for a request whose prefill chunk did
    not reach the end of its prompt (nothing is sampled for it this step);
    for a request with drafts it is the accepted drafts then one token of
    the model's own.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[Logprobs | None] | None = None
    finished_sending: list[str] = []
    finished_recving: list[str] = []
    invalid_block_ids: list[int] = []
    kv_connector_stats: Any = None  # Any: the connector's own report Struct

    @classmethod
    def empty(cls) -> "ModelRunnerOutput":
        return cls(req_ids=[], sampled_token_ids=[])


class RequestOutput(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """One streamed piece of a request's result (the delta since the last one).

    ``finish_reason`` is None while the request runs, then one of
    "stop", "length", "abort", "error"; ``error`` carries the message when
    the request failed (a bad parameter, an engine fault).
    """

    request_id: str
    new_token_ids: list[int] = []
    text_delta: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[Logprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


class HistogramSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Observations since start: ``counts[i]`` of them fell in
    ``(bounds[i-1], bounds[i]]``; the last count is above every bound (+Inf).
    Counts are per bucket; Prometheus' cumulative ``le`` counts are their
    running sums."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float = 0.0
    count: int = 0


class BlockResidencyStats(msgspec.Struct, frozen=True, kw_only=True):
    """Sampled device KV blocks since start: a fraction ``sample_rate`` of
    block allocations is followed until the block is evicted. Per evicted
    sample: its lifetime (allocation to eviction), its idle time before
    eviction (last use to eviction) and the gaps between its reuses (prefix
    hits); ``num_reuses`` counts those hits."""

    sample_rate: float
    num_samples: int
    num_reuses: int
    lifetime_s: HistogramSnapshot
    idle_before_eviction_s: HistogramSnapshot
    reuse_gap_s: HistogramSnapshot


class EngineLoad(msgspec.Struct, frozen=True, kw_only=True):
    """The work an engine has now, for routers: ``queued_prefill_tokens``
    is what its waiting requests (preempted ones included) and its running
    requests still in prefill have left to compute; ``num_running`` and
    ``num_waiting`` count requests."""

    queued_prefill_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0


class EngineHealth(msgspec.Struct, frozen=True, kw_only=True):
    """Whether the engine serves. ``status``:

        ok        it serves (healthy)
        degraded  a fleet: some replicas serve, the ones in ``replicas_down``
                  do not (healthy: requests are routed to the others)
        starting  not serving yet: the engine (or, in a fleet with none
                  serving, a replica) is still being started or connected
        stalled   work is queued and no step has made progress for longer
                  than ``scheduler.stall_timeout_s`` (a hung model step,
                  loads that never land, a scheduling bug)
        dead      a fleet with no replica serving and none being started

    ``seconds_since_progress`` is 0 while idle; ``replicas_down`` names a
    fleet's replicas that do not serve (empty for one engine)."""

    healthy: bool
    status: str
    reason: str | None = None
    seconds_since_progress: float = 0.0
    num_unfinished: int = 0
    replicas_down: tuple[str, ...] = ()


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the engine's counters since start, for `/metrics` and
    the load tests.

    ``prefix_cache_queries``/``hits``: prompt tokens looked up in / found in
    the device prefix cache, counted once per admission (of a new or a
    preempted request) by the KV cache manager.
    ``block_residency`` is None when block sampling is off. ``extra``
    carries component-specific gauges and counters by dotted name (for
    example ``"kv.prefix_cache.preempted_hits"`` or ``"store.cpu.hit_tokens"``).
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    block_residency: BlockResidencyStats | None = None
    extra: dict[str, float] = {}
