"""The "null" executor: the model runner's interface with no model behind it.

It measures engine overhead (scheduling, KV management, streaming) with
the model's cost removed. It tracks only how many tokens each request has and
has computed, and returns for each request that reaches its end a
deterministic token: the letters ``a``..``z`` cycling with the token's
position (byte ids 97..122), skipping EOS ids, so requests run to
``max_tokens`` unless they set stop strings. No tensors are touched per step.

Its KV geometry is the model's (config.json, or the default model's config),
so the KV manager sizes its pool as with the real runner; no cache memory is
allocated.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvstrata.config import CacheConfig, ModelConfig
from kvstrata.worker.model.config import CheckpointError, parse_arch_config
from kvstrata.worker.model.default_model import DEFAULT_MODEL_CONFIG
from kvstrata.kv import KVCacheSpec
from kvstrata.worker.model_runner import check_max_model_len, layer_kv_specs
from kvstrata.text.tokenizer import load_tokenizer
from kvstrata.types import ModelRunnerOutput, SchedulerOutput

_FIRST, _SPAN = 97, 26


class NullModelRunner:
    """Owns: per request [known tokens, computed tokens] counters."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device: str = "cpu",
                 scheduler_config: object = None, *, max_drafts: int = 0) -> None:
        """``scheduler_config`` and ``max_drafts`` are taken for the same signature as ModelRunner's and not used."""
        raw = DEFAULT_MODEL_CONFIG
        if model_config.model is not None:
            path = Path(model_config.model).expanduser() / "config.json"
            if not path.is_file():
                raise CheckpointError(f"model: {str(path.parent)!r} is missing config.json")
            raw = json.loads(path.read_text(encoding="utf-8"))
        self.arch = parse_arch_config(raw, "config.json")
        self.device = device
        self.tokenizer = load_tokenizer(model_config.tokenizer or model_config.model)
        self.vocab_size: int = self.arch.vocab_size
        self.can_blend = False
        self.max_model_len: int = check_max_model_len(model_config.max_model_len, self.arch.max_position_embeddings)
        eos = [*self.tokenizer.eos_token_ids, *self.arch.eos_token_ids]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(t for t in eos if t is not None))
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        digest = hashlib.sha256(b"kvstrata-null-runner\0" + json.dumps(raw, sort_keys=True).encode())
        self.model_fingerprint: str = digest.hexdigest()
        self.dtype = model_config.dtype if model_config.dtype != "auto" else "float32"
        self.block_size = cache_config.block_size
        self.num_blocks = 0
        self._reqs: dict[str, list[int]] = {}
        self._tokens = [t for t in range(_FIRST, _FIRST + _SPAN) if t not in self.eos_token_ids and t < self.vocab_size]
        if not self._tokens:
            self._tokens = [t for t in range(self.vocab_size) if t not in self.eos_token_ids][:_SPAN]

    def kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return layer_kv_specs(self.arch, self.dtype, self.block_size)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        reqs = self._reqs
        so = scheduler_output
        for req_id in so.finished_req_ids:
            reqs.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            reqs.pop(req_id, None)
        for data in so.scheduled_new_reqs:
            reqs[data.req_id] = [len(data.token_ids), data.num_computed_tokens]
        cached = so.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            reqs[req_id][1] = num_computed
        tokens, span = self._tokens, len(self._tokens)
        sampled: list[list[int]] = []
        spec = so.scheduled_spec_decode_tokens  # drafts: all rejected (its "model" predicts its fixed token)
        for req_id, n in so.num_scheduled_tokens.items():
            counts = reqs[req_id]
            counts[1] += n - len(spec.get(req_id, ()))
            if counts[1] >= counts[0]:
                sampled.append([tokens[counts[0] % span]])
                counts[0] += 1
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens), sampled_token_ids=sampled)
