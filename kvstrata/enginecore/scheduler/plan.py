"""What one schedule() call has decided so far, and the SchedulerOutput it
becomes."""

from __future__ import annotations

from collections.abc import Callable

from kvstrata.enginecore.request import Request
from kvstrata.types import CachedRequestData, NewRequestData, SchedulerOutput


class StepPlan:
    """The running requests scheduled so far in one schedule() call, as
    parallel lists (the shape CachedRequestData wants), the tokens of every
    scheduled request, the requests preempted on the way, and where each
    sync load of the step starts (``loaded_from``: its first token)."""

    __slots__ = ("reqs", "prev_computed", "new_blocks", "n", "num_scheduled", "preempted", "spec", "loaded_from")

    def __init__(self) -> None:
        self.reqs: list[Request] = []
        self.prev_computed: list[int] = []
        self.new_blocks: list = []
        self.n: list[int] = []
        self.num_scheduled: dict[str, int] = {}
        self.preempted: list[Request] = []
        self.spec: dict[str, list[int]] = {}  # draft tokens scheduled with a request's next token
        self.loaded_from: dict[str, int] = {}

    def unschedule(self, req: Request) -> int:
        """Take back ``req``'s place in this step; returns its tokens."""
        j = self.reqs.index(req)
        del self.reqs[j], self.prev_computed[j], self.new_blocks[j], self.n[j]
        self.spec.pop(req.request_id, None)
        self.loaded_from.pop(req.request_id, None)
        return self.num_scheduled.pop(req.request_id)

    def advance(self, new_reqs: list[Request]) -> list[Request]:
        """Count the step's tokens as computed (its output carries the counts
        before); returns the requests it samples for, each now expecting one
        token more (a placeholder until the step's output comes back)."""
        sampling: list[Request] = []
        for r, n in zip(self.reqs, self.n):
            r.num_computed_tokens += n
            if r.num_computed_tokens >= len(r.all_token_ids) + r.num_output_placeholders:
                sampling.append(r)
        for r in new_reqs:
            r.num_computed_tokens += self.num_scheduled[r.request_id]
            if r.num_computed_tokens >= len(r.all_token_ids) + r.num_output_placeholders:
                sampling.append(r)
        for r in sampling:
            r.num_output_placeholders += 1
        return sampling

    def write_starts(self, new_reqs: list[Request]) -> dict[str, int]:
        """Per scheduled request, the first token whose KV this step writes
        (its first loaded token, else its first computed one). Reads the
        requests' counts before this step advances them."""
        starts = dict(zip([r.request_id for r in self.reqs], self.prev_computed, strict=True))
        for r in new_reqs:
            starts[r.request_id] = r.num_computed_tokens
        for rid, pos in self.loaded_from.items():
            if rid in starts:
                starts[rid] = min(starts[rid], pos)
        return starts

    def to_output(
        self,
        new_reqs: list[Request],
        total: int,
        finished_req_ids: list[str],
        block_ids: Callable[[str], tuple[list[int], ...]],
    ) -> SchedulerOutput:
        """The step as a diff: new requests in full (their block tables from
        ``block_ids``, the KV manager's), running ones as deltas. Reads the
        requests' counts before this step advances them."""
        return SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    req_id=r.request_id,
                    token_ids=list(r.all_token_ids),
                    num_prompt_tokens=r.num_prompt_tokens,
                    sampling_params=r.sampling_params,
                    block_ids=block_ids(r.request_id),
                    num_computed_tokens=r.num_computed_tokens,
                    lora_name=r.lora_name,
                )
                for r in new_reqs
            ],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r in self.reqs],
                new_block_ids=self.new_blocks,
                num_computed_tokens=self.prev_computed,
            ),
            num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=finished_req_ids,
            preempted_req_ids=[r.request_id for r in self.preempted],
            scheduled_spec_decode_tokens=self.spec,
        )
