"""A running request computing the front of a split tier hit (load or
compute, ``connector/offload/costs.py``): it computes up to its
``load_at``, then asks the connector for the loaded tokens again."""

from __future__ import annotations

from kvstrata.connector.base import KVConnectorScheduler
from kvstrata.enginecore.request import Request


def split_load(req: Request, connector: KVConnectorScheduler, nc: int, n: int) -> tuple[int, int]:
    """For ``req`` (``nc`` tokens computed, ``n`` left to compute) with a
    ``load_at``: the tokens to load now and the tokens to compute this step.
    Before ``load_at`` it computes up to it; there, the connector answers the
    loaded tokens, or (not landed yet) a further point to compute to, which
    becomes the new ``load_at``."""
    load_at = req.load_at
    assert load_at is not None
    if nc < load_at:
        return 0, min(n, load_at - nc)
    ext, _ = connector.get_num_new_matched_tokens(req, nc)  # split loads are synchronous
    if ext is None:
        req.load_at = connector.load_point(req)
        if req.load_at is not None:
            n = min(n, req.load_at - nc)
        return 0, n
    req.load_at = None
    ext = max(0, min(ext, len(req.all_token_ids) - 1 - nc))
    return ext, n - ext
