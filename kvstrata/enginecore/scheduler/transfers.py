"""The scheduler's side of KV transfers: ``TransferTracker`` remembers which
requests wait on the worker, and turns one step's connector results into a
``Settlement``, the decisions the Scheduler applies to requests and blocks.

    sync load  (blocks filled inside the step, layer by layer): the blocks are
               allocated uncached; after the step they are cached, or, if the
               worker reports any of them invalid, the request rolls back to
               its first failed block (the runner withheld its sampled token)
               and recomputes from there
    async load (request parked in WAITING_FOR_REMOTE_KVS): admitted once the
               worker names it in ``finished_recving``; invalid blocks roll it
               back the same way before its loaded blocks are cached
    delayed free: a finished request's blocks go back to the pool once the
               worker names it in ``finished_sending``

A failed load is never wrong tokens: its blocks are evicted from the device
prefix cache and recomputed.

Sync loads belong to the step that makes them: recorded while it is
planned, ``seal(step)`` names that step once its output exists, and
``settle(out, step)`` takes exactly that step's. With async scheduling the
next step is planned before this one is settled; a request whose sync load
is still in flight (``sync_in_flight``) is not scheduled again until then,
since a failed block rolls it back (the runner withheld its sample) and a
step planned on top of the load would compute, or save, past KV that is
not there.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstrata.enginecore.request import Request, RequestStatus
from kvstrata.types import ModelRunnerOutput

_RUNNING = RequestStatus.RUNNING


class Settlement:
    """What one step's transfer results ask of the scheduler, in this order:
    uncache the ``evict`` block ids; roll each of ``roll_back`` back to its
    token position (a sync load that failed); cache the computed blocks of
    each of ``cache`` (sync loads that arrived); free the blocks of each of
    ``free`` (finished requests whose save is done)."""

    __slots__ = ("evict", "roll_back", "cache", "free")

    def __init__(self, evict: list[int]) -> None:
        self.evict = evict
        self.roll_back: list[tuple[Request, int]] = []
        self.cache: list[Request] = []
        self.free: list[Request] = []

    def __bool__(self) -> bool:
        return bool(self.evict or self.roll_back or self.cache or self.free)


_NOTHING = Settlement([])  # never mutated: the answer of a step with no transfers


class Landed:
    """An async load the worker reported done: where the request must
    recompute from (its first failed block), or None if every block arrived."""

    __slots__ = ("roll_back_to",)

    def __init__(self, roll_back_to: int | None) -> None:
        self.roll_back_to = roll_back_to


class TransferTracker:
    """Owns: the async loads in flight (``loading``, request ids, until the
    request is admitted or finishes), the loads the worker reported done
    (with the position a failed block rolls them back to), the sync loads
    of the step being planned and of each step in flight (by step key), the
    steps with transfers in flight and, per id of a request that finished
    mid async load, those of them whose report of the id is still its own
    (a request added since under the same id waits for its own report), and
    the finished requests whose blocks wait for a save. Reads block tables
    through ``block_ids`` (the KV manager's); changes nothing but its own
    state: the Scheduler applies what it returns."""

    __slots__ = ("loading", "_landed", "_planned", "_sync", "_open", "_stale", "_delayed", "_block_ids",
                 "_block_size")

    def __init__(self, block_size: int, block_ids: Callable[[str], tuple[list[int], ...]]) -> None:
        self.loading: set[str] = set()
        self._landed: dict[str, int | None] = {}
        self._planned: list[Request] = []  # sync loads of the step being planned
        self._sync: dict[int, list[Request]] = {}  # step key -> its sync loads, until settled
        self._open: set[int] = set()  # steps with transfers sealed and not yet settled (or failed)
        # request id -> the steps in flight when a request of that id finished
        # mid async load: their report of the id is that request's, not a
        # later one's that took the id
        self._stale: dict[str, set[int]] = {}
        self._delayed: dict[str, Request] = {}
        self._block_ids = block_ids
        self._block_size = block_size

    # -- recording --------------------------------------------------------
    def start_async_load(self, request_id: str) -> None:
        self.loading.add(request_id)

    def start_sync_load(self, request: Request) -> None:
        """``request``'s external blocks are filled by the step being planned."""
        self._planned.append(request)

    def seal(self, step: int, *, transfers: bool = True) -> None:
        """The step being planned is ``step`` (a key the caller settles it
        by): its sync loads are that step's from now on, but for those of
        requests preempted while it was planned (it loads nothing for them).
        ``transfers``: it carries connector metadata (so it runs, and is
        settled or failed); a step without may be dropped unrun."""
        loads, self._planned = self._planned, []
        loads = [r for r in loads if r.status is _RUNNING]
        if loads:
            self._sync[step] = loads
        if transfers:
            self._open.add(step)

    def delay_free(self, request: Request) -> None:
        """``request`` finished; its blocks stay held until its save is reported."""
        self._delayed[request.request_id] = request

    def forget(self, request_id: str) -> bool:
        """The request finished: drop its load state. True if a load may
        still be filling its blocks (they must never be cached): an async
        load, or a sync load riding on a step not settled yet."""
        loading = request_id in self.loading
        if loading and request_id not in self._landed and self._open:
            self._stale[request_id] = set(self._open)
        self.loading.discard(request_id)
        self._landed.pop(request_id, None)
        planned = any(r.request_id == request_id for r in self._planned)
        return loading or planned or request_id in self.sync_in_flight()

    # -- answers ----------------------------------------------------------
    def has_pending(self) -> bool:
        """Loads or saves the worker has yet to report: it must be stepped
        (even with nothing to compute) to report them."""
        return bool(self.loading) or bool(self._delayed)

    def sync_in_flight(self) -> frozenset[str]:
        """The requests whose sync load rides on a step not settled yet."""
        if not self._sync:
            return frozenset()
        return frozenset(r.request_id for loads in self._sync.values() for r in loads)

    def in_flight(self, request_id: str) -> bool:
        """An async load is still filling the request's blocks (they can be
        neither freed nor reused until the worker reports it)."""
        return request_id in self.loading and request_id not in self._landed

    def take_landed(self, request_id: str) -> Landed | None:
        """The request's async load, once the worker reported it done (the
        request is then no longer loading); None while it is in flight."""
        if request_id not in self._landed:
            return None
        self.loading.discard(request_id)
        return Landed(self._landed.pop(request_id))

    def settle(self, out: ModelRunnerOutput, step: int | None = None) -> Settlement:
        """Take in the connector results of step ``step`` (before its sampled
        tokens); returns what the scheduler must do. That step's sync loads
        are done (``step`` None: those not sealed yet, for a caller that
        settles each step before planning the next)."""
        loads = self._take_sync(step)
        stale = self._close(step)
        if not (loads or out.invalid_block_ids or out.finished_recving or out.finished_sending):
            return _NOTHING
        invalid = set(out.invalid_block_ids)
        st = Settlement(sorted(invalid))
        for req in loads:
            if req.status is not _RUNNING:
                continue  # finished or aborted while the step ran
            pos = self._first_failed_token(req.request_id, invalid) if invalid else None
            if pos is None:
                st.cache.append(req)
            elif pos < req.num_computed_tokens:
                st.roll_back.append((req, pos))
        for rid in out.finished_recving:
            if rid not in self.loading or rid in stale:
                continue  # finished (aborted) while it loaded; or that request's, the id taken since
            pos = self._first_failed_token(rid, invalid) if invalid else None
            if pos is not None or rid not in self._landed:
                self._landed[rid] = pos
        for rid in out.finished_sending:
            req = self._delayed.pop(rid, None)
            if req is not None:
                st.free.append(req)
        return st

    def step_failed(self, step: int | None = None) -> None:
        """Step ``step`` raised before filling its sync loads: forget them
        (their requests were failed with the step)."""
        self._take_sync(step)
        self._close(step)

    def _close(self, step: int | None) -> frozenset[str]:
        """Step ``step`` is settled: it is no longer in flight. Returns the
        ids whose report from it belongs to a request that finished."""
        if step is None or step not in self._open:
            return frozenset()
        self._open.discard(step)
        if not self._stale:
            return frozenset()
        stale = frozenset(rid for rid, steps in self._stale.items() if step in steps)
        for rid in stale:
            steps = self._stale[rid]
            steps.discard(step)
            if not steps:
                del self._stale[rid]
        return stale

    def _take_sync(self, step: int | None) -> list[Request]:
        if step is None:
            loads, self._planned = self._planned, []
            return loads
        return self._sync.pop(step, [])

    def _first_failed_token(self, request_id: str, invalid: set[int]) -> int | None:
        """Token position of the request's first block in ``invalid``, or None."""
        for i, b in enumerate(self._block_ids(request_id)[0]):
            if b in invalid:
                return i * self._block_size
        return None
