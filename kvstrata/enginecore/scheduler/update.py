"""One step's sampled tokens applied to its requests: tokens appended, stop
checks, and the count of computed tokens moved back over rejected drafts.
The Scheduler owns the requests and applies what this returns (it frees the
stopped ones through ``finish``)."""

from __future__ import annotations

from collections.abc import Callable

from kvstrata.enginecore.request import Request, RequestStatus
from kvstrata.enginecore.scheduler.stop import append_and_check
from kvstrata.enginecore.spec_decode import SpecDecodeCounters
from kvstrata.types import Logprobs, ModelRunnerOutput, RequestOutput, SchedulerOutput

_RUNNING = RequestStatus.RUNNING
_LENGTH = RequestStatus.FINISHED_LENGTH
_STOPPED = RequestStatus.FINISHED_STOPPED

# Stops a running request and returns its final output (Scheduler._finish).
Finish = Callable[[Request, RequestStatus, list[int], Logprobs | None], RequestOutput]


def apply_sampled(requests: dict[str, Request], so: SchedulerOutput, out: ModelRunnerOutput, *,
                  max_model_len: int, spec_counters: SpecDecodeCounters,
                  finish: Finish) -> tuple[list[RequestOutput], list[Request], int]:
    """Apply step ``so``'s sampled tokens (``out``) to the live ``requests``.
    Returns the outputs to stream, the requests that stopped (``finish``ed;
    the caller drops them from ``running``) and the tokens generated."""
    outputs: list[RequestOutput] = []
    stopped: list[Request] = []
    sampled = out.sampled_token_ids
    logprobs = out.logprobs
    num_generated = 0
    spec = so.scheduled_spec_decode_tokens
    for i, rid in enumerate(out.req_ids):
        new_ids = sampled[i]
        if spec and rid in spec:
            settle_drafts(requests.get(rid), len(spec[rid]), len(new_ids), spec_counters)
        if not new_ids:
            continue  # a prefill chunk short of the prompt's end
        req = requests.get(rid)
        if req is None or req.status is not _RUNNING:
            continue  # aborted (or replaced) while the step ran
        if len(new_ids) == 1:
            # append_and_check inlined for the one-token case (the hot path:
            # a call per request per step measured +5% on the scheduler step)
            tok = new_ids[0]
            ids = req.all_token_ids
            ids.append(tok)
            num_tokens = len(ids)
            if num_tokens >= req.hash_boundary:
                req.grow_block_hashes()
            num_out = num_tokens - req.num_prompt_tokens
            if num_out >= req.max_tokens or num_tokens >= max_model_len:
                status = _LENGTH
            elif tok in req.stop_ids and num_out >= req.min_tokens:
                status = _STOPPED
                req.stop_reason = None if tok in req.eos_token_ids else tok
            else:
                status = None
        else:
            new_ids, status = append_and_check(req, new_ids, max_model_len)
        num_generated += len(new_ids)
        lp = logprobs[i] if logprobs is not None else None
        if status is not None:
            stopped.append(req)
            outputs.append(finish(req, status, new_ids, lp))
            continue
        outputs.append(RequestOutput(
            request_id=rid, new_token_ids=new_ids,
            logprobs=None if lp is None else [lp],
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
        ))
    return outputs, stopped, num_generated


def settle_drafts(req: Request | None, num_drafts: int, num_sampled: int, counters: SpecDecodeCounters) -> None:
    """``num_drafts`` were computed after the request's token; the runner
    kept ``num_sampled - 1`` of them (and one token of its own). The
    rejected positions are not computed: the count goes back over them,
    so their slots are recomputed next, and blocks are registered only
    up to the committed tokens (never a block holding rejected KV)."""
    accepted = max(num_sampled - 1, 0)
    counters.record(num_drafts, accepted)
    if req is not None and req.status is _RUNNING:
        req.num_computed_tokens -= num_drafts - accepted
