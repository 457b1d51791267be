"""A request's lifecycle state as the scheduler and the KV cache manager see it.

    add ──► WAITING ──► RUNNING ──► FINISHED_(STOPPED | LENGTH | ABORTED | ERROR)
              ▲  │         │
              │  ▼         ▼ (no room for its next slots)
   WAITING_FOR_REMOTE_KVS  PREEMPTED ──► front of the waiting queue, recomputed later

``EngineRequest`` is the frozen input that crosses the engine boundary (a
client, the ZMQ socket). ``Request`` is the mutable, loop-owned object built
from it; it satisfies the ``KVRequest`` protocol of ``kvstrata.kv``
(``all_token_ids``, ``num_tokens``, ``block_hashes``, ...).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from kvstrata.types import SamplingParams

if TYPE_CHECKING:
    from kvstrata.kv.types import BlockHash


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status > PREEMPTED`` means finished."""

    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class EngineRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A tokenized request as submitted to the engine core.

    ``arrival_time`` is in the engine process's ``time.monotonic()`` seconds;
    0 means "stamp it on arrival" (what clients in other processes send).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None
    # The prompt's full-block hash chain as a fleet client computed it for
    # routing (one hash pass per request): the engine uses it instead of
    # hashing the prompt when it has exactly one hash per full block of its
    # hasher, of its digest size; otherwise it hashes as for any request.
    block_hashes: list[bytes] | None = None


BlockHasher = Callable[["Request"], "list[BlockHash]"]  # kvstrata.kv.BlockHasher: the hashes of newly full blocks


class Request:
    """One request inside the engine core.

    Owned by the Scheduler: only it (on the event loop) mutates the status,
    the token list and the counters. ``block_hashes`` grows by itself as
    tokens are appended: whenever a block of ``hash_block_size`` tokens fills
    up, the block hasher adds the hashes of the newly full blocks, so the KV
    manager never hashes tokens twice.

    Which blocks the request holds is the KV cache manager's to know (keyed
    by ``request_id``); nothing here copies it.
    """

    __slots__ = (
        "request_id", "all_token_ids", "num_prompt_tokens", "sampling_params",
        "arrival_time", "priority", "cache_salt", "lora_name", "mm_features",
        "prompt_embeds_digest", "block_hashes", "num_computed_tokens",
        "num_cached_tokens", "num_preemptions",
        "status", "stop_reason", "max_tokens", "min_tokens",
        "stop_ids", "eos_token_ids", "seq", "sort_key",
        "_block_hasher", "_hash_block_size", "hash_boundary", "spec_token_ids",
        "num_output_placeholders", "load_at",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        block_hasher: BlockHasher | None = None,
        hash_block_size: int = 0,
        block_hashes: list | None = None,
    ) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.mm_features: list = []
        self.prompt_embeds_digest: bytes | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set at the first schedule: the prefix hit
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.max_tokens = sampling_params.max_tokens
        self.min_tokens = sampling_params.min_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        stop_ids = set(sampling_params.stop_token_ids)
        if not sampling_params.ignore_eos:
            stop_ids.update(eos_token_ids)
        # One membership test per sampled token covers EOS and stop_token_ids.
        self.stop_ids = frozenset(stop_ids)
        self.seq = 0  # admission order, set by the scheduler; breaks ties
        # Draft tokens for the next step (a proposer's; kvstrata.enginecore.spec_decode):
        # computed with the next token and verified by the model, never part of all_token_ids.
        self.spec_token_ids: list[int] = []
        # Tokens a scheduled step will sample for this request that have not
        # come back yet (async scheduling schedules the next step before they do).
        self.num_output_placeholders = 0
        # Load or compute: the connector loads the stored tokens from here
        # while the scheduler computes up to it (its ``load_point``); None: no split.
        self.load_at: int | None = None
        self.sort_key: tuple = (priority, self.arrival_time, 0)
        # ``block_hashes`` given: the prompt's chain, already checked by the caller.
        self.block_hashes: list = [] if block_hashes is None else list(block_hashes)
        self._block_hasher = block_hasher
        self._hash_block_size = hash_block_size
        # Token count at which the next block fills and needs its hash; the
        # scheduler's inlined append compares against it.
        self.hash_boundary = 1 << 62
        if block_hasher is not None:
            if hash_block_size < 1:
                raise ValueError("hash_block_size must be >= 1 when a block hasher is given")
            self.grow_block_hashes()

    # -- the KVRequest protocol -------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    # -- derived views (not on hot paths) ---------------------------------
    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    # -- mutation (scheduler only) ----------------------------------------
    def append_output_token_ids(self, token_ids: list[int]) -> None:
        ids = self.all_token_ids
        ids.extend(token_ids)
        if len(ids) >= self.hash_boundary:
            self.grow_block_hashes()

    def grow_block_hashes(self) -> None:
        """Hash the blocks that filled up since the last call."""
        hasher = self._block_hasher
        assert hasher is not None
        self.block_hashes.extend(hasher(self))
        self.hash_boundary = (len(self.block_hashes) + 1) * self._hash_block_size

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={len(self.all_token_ids)}, computed={self.num_computed_tokens})"
        )

