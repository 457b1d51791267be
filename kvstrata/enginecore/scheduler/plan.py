"""What one schedule() call has decided so far for the running requests."""

from __future__ import annotations

from kvstrata.enginecore.request import Request


class StepPlan:
    """The running requests scheduled so far in one schedule() call, as
    parallel lists (the shape CachedRequestData wants)."""

    __slots__ = ("reqs", "prev_computed", "new_blocks", "n", "num_scheduled", "preempted")

    def __init__(self) -> None:
        self.reqs: list[Request] = []
        self.prev_computed: list[int] = []
        self.new_blocks: list = []
        self.n: list[int] = []
        self.num_scheduled: dict[str, int] = {}
        self.preempted: list[Request] = []

    def unschedule(self, req: Request) -> int:
        """Take back ``req``'s place in this step; returns its tokens."""
        j = self.reqs.index(req)
        del self.reqs[j], self.prev_computed[j], self.new_blocks[j], self.n[j]
        return self.num_scheduled.pop(req.request_id)
