"""A launched step's output, read back later (pipelined steps).

``ModelRunner.launch`` queues a step on the device and returns at once: the
sampled token ids stay on the device, where the next step's decode inputs
read them (``InputBatch._feed``), and travel to pinned host memory with a
non-blocking copy behind an event. ``result()`` waits for that event, appends
each token to its request's host copy and builds the ``ModelRunnerOutput``:
the one host sync of the step, paid after the next step was launched.

    launch N ─► launch N+1 ─► result N ─► launch N+2 ─► result N+1 ...
                 (reads N's tokens on the device)

Steps that must read their tokens before the next one is built (a KV
connector, draft tokens, logprobs) are computed whole and wrapped in
``Ready``; a launch that raised is a ``Failed``, whose ``result()`` raises.
"""

from __future__ import annotations

import torch

from kvstrata.types import ModelRunnerOutput
from kvstrata.worker.input_batch import RequestState


class Ready:
    """A step computed whole: its output is known."""

    __slots__ = ("output",)

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output


class Failed:
    """A launch that raised: ``result()`` raises it, in the step's turn."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error

    def result(self) -> ModelRunnerOutput:
        raise self.error


class PendingStep:
    """Owns: one launched step's sampled tokens on their way to the host (a
    pinned buffer and the event after its copy) until ``result()``, which is
    idempotent. The requests it sampled carry ``flight = (tokens, row)``
    until then."""

    __slots__ = ("req_ids", "states", "batch_idx", "tokens", "_host", "_event", "_output")

    def __init__(self, req_ids: list[str], states: list[RequestState], batch_idx: list[int],
                 tokens: torch.Tensor) -> None:
        self.req_ids = req_ids
        self.states = states
        self.batch_idx = batch_idx
        self.tokens = tokens
        self._output: ModelRunnerOutput | None = None
        self._event: torch.cuda.Event | None = None
        if tokens.device.type == "cpu":
            self._host = tokens
        else:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        for row, state in enumerate(states):
            state.flight = (tokens, row)

    def result(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        try:
            if self._event is not None:
                self._event.synchronize()
            sampled = self._host.tolist()
        finally:
            for state in self.states:  # landed (or lost: the step's requests fail)
                if state.flight is not None and state.flight[0] is self.tokens:
                    state.flight = None
        ids: list[list[int]] = [[] for _ in self.req_ids]
        for state, b, token in zip(self.states, self.batch_idx, sampled, strict=True):
            state.token_ids.append(token)
            ids[b] = [token]
        self._output = ModelRunnerOutput(req_ids=self.req_ids, sampled_token_ids=ids)
        return self._output


Launched = Ready | Failed | PendingStep
