"""Speculative decoding: proposers of draft tokens, and what the engine
counts about them.

    step N     the model computes each running request's next token plus its
               drafts (``Request.spec_token_ids``, at most k), verifying them
               in the same forward pass: the runner's rejection sampler keeps
               the drafts that agree with the model (greedy: equal to its
               argmax; sampling: accepted with the target probability, the
               first rejected one resampled from the rest, so the output
               distribution is the model's) plus one token of its own
    update     the scheduler appends the kept tokens and moves the request's
               computed count back over the rejected positions: their slots
               are reused by the next step, and no block holding rejected KV
               is ever registered in the prefix cache (registration stops at
               the committed tokens)
    propose    the engine asks the proposer for the next drafts of every
               running request (``Proposer.propose``), from its committed
               tokens

A proposer sees requests, never the scheduler: ``propose(requests)`` returns
``{request_id: drafts}`` and the engine stores them on the requests. The
n-gram proposer here runs on the engine loop (a lookup in the request's
tokens). A draft-model or EAGLE proposer fits the same interface: it runs its
model for the running requests (on the worker, from the last step's hidden
states for EAGLE) and returns the drafts; the scheduler only budgets
``len(spec_token_ids)`` more tokens and the runner verifies whatever it got.

Requests that ask for logprobs, have a seed, or are still under
``min_tokens`` get no drafts (their per-position sampling rules are kept
exact by sampling one token at a time).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Protocol

import msgspec

from kvstrata.config import SpeculativeConfig
from kvstrata.enginecore.request import Request


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request]) -> dict[str, list[int]]:
        """Drafts for the next step of each running request (absent or empty: none)."""
        ...


def drafts_allowed(req: Request, max_model_len: int) -> int:
    """How many drafts ``req`` may take next step: none for requests whose
    sampling must stay one token at a time; never past max_tokens or
    max_model_len (the next step's own token counts too)."""
    p = req.sampling_params
    if p.logprobs is not None or (p.seed is not None and not p.greedy):
        return 0
    num_out = len(req.all_token_ids) - req.num_prompt_tokens
    if num_out < req.min_tokens:
        return 0
    return max(0, min(req.max_tokens - num_out - 1, max_model_len - len(req.all_token_ids) - 1))


def ngram_lookup(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup: for n from ``max_n`` down to ``min_n``, find the most
    recent earlier occurrence of the last n tokens and return up to ``k``
    tokens that followed it; [] when none matches. The search runs in C
    (``bytes.rfind`` over the tokens as u32), not token by token."""
    total = len(tokens)
    if total < min_n + 1 or k < 1:
        return []
    data = array("I", tokens).tobytes()
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        tail = data[(total - n) * 4:]
        end = (total - 1) * 4  # an occurrence must end before the last token: something follows it
        while True:
            at = data.rfind(tail, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                start = at // 4 + n
                return list(tokens[start:start + k])
            end = at + len(tail) - 1  # a match across token boundaries: look further left
    return []


class NgramProposer:
    """Owns nothing mutable: the lookup's parameters."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, requests: Sequence[Request]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for req in requests:
            room = min(self.k, drafts_allowed(req, self.max_model_len))
            if room:
                drafts = ngram_lookup(req.all_token_ids, self.min_n, self.max_n, room)
                if drafts:
                    out[req.request_id] = drafts
        return out


def make_proposer(config: SpeculativeConfig, max_model_len: int) -> Proposer | None:
    if config.method is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config, max_model_len)
    raise ValueError(f"speculative.method must be 'ngram' or unset, got {config.method!r}")


class SpecDecodeCounters(msgspec.Struct, kw_only=True):
    """Drafts scheduled and accepted, and acceptances per draft position."""

    num_drafts: int = 0  # requests that had drafts verified (verification rounds)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = msgspec.field(default_factory=list)
    proposed_per_position: list[int] = msgspec.field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos_list, n in ((self.proposed_per_position, num_drafts), (self.accepted_per_position, num_accepted)):
            if len(pos_list) < n:
                pos_list.extend([0] * (n - len(pos_list)))
            for j in range(n):
                pos_list[j] += 1

    def as_extra(self) -> dict[str, float]:
        """For ``EngineStats.extra`` (and so /metrics and the bench report)."""
        out = {
            "spec.num_drafts": float(self.num_drafts),
            "spec.num_draft_tokens": float(self.num_draft_tokens),
            "spec.num_accepted_tokens": float(self.num_accepted_tokens),
            "spec.acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                     if self.num_draft_tokens else 0.0),
            "spec.mean_accepted_length": (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0),
        }
        for j, (acc, prop) in enumerate(zip(self.accepted_per_position, self.proposed_per_position)):
            out[f"spec.acceptance_rate.pos{j}"] = acc / prop if prop else 0.0
        return out
