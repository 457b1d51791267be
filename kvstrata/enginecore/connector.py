"""The scheduler side of a KV connector: how the scheduler asks an external
KV store (the tiers of ``kvstrata.io``) for prefix hits, and tells it what
was allocated, scheduled and finished. vLLM v1's KVConnectorBase_V1
scheduler role, reduced to the four calls the scheduler makes:

    schedule(), per waiting request with nothing computed yet:
        get_num_new_matched_tokens(req, num_local_hit)   -> (n_external | None, load_async)
        ... allocate_slots(req, ..., num_external_computed_tokens=n_external)
        update_state_after_alloc(req, all_block_ids, n_external)
    schedule(), once per step, on the finished output:
        build_connector_meta(scheduler_output)           -> opaque metadata for the worker
    when a request finishes (stop, length, abort, error):
        request_finished(req, all_block_ids)             -> (delay_free, params)

``n_external`` is None when the connector cannot tell yet (the request
stays waiting and is asked again next step). ``load_async`` parks the
request in WAITING_FOR_REMOTE_KVS until the worker reports it in
``ModelRunnerOutput.finished_recving``. ``delay_free`` keeps the request's
blocks until the worker reports it in ``finished_sending`` (a save in
flight). ``NoOpConnector`` is what runs until the tiered store lands.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvstrata.enginecore.request import Request


class KVConnectorScheduler(Protocol):
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None: ...

    def build_connector_meta(self, scheduler_output: Any) -> Any: ...

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]: ...


class NoOpConnector:
    """No external store: no hits, nothing to load or save, never delays a free."""

    is_noop = True

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return None

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None
