"""Stop conditions, checked after each sampled token (vLLM v1's check_stop).

Order, as in vLLM: length first (max_tokens, max_model_len), then, once
``min_tokens`` outputs exist, EOS (unless ignore_eos) and stop_token_ids.
Stop strings are text, so the client applies them
(``kvstrata.enginecore.processing.OutputProcessor``) and aborts the request.
"""

from __future__ import annotations

from kvstrata.enginecore.request import Request, RequestStatus

_LENGTH = RequestStatus.FINISHED_LENGTH
_STOPPED = RequestStatus.FINISHED_STOPPED


def check_token_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """Stop status after the last appended token, or None to keep going.

    Sets ``request.stop_reason`` to the stop token id (None for EOS).
    """
    ids = request.all_token_ids
    num_tokens = len(ids)
    num_output = num_tokens - request.num_prompt_tokens
    if num_output >= request.max_tokens or num_tokens >= max_model_len:
        return _LENGTH
    if num_output < request.min_tokens:
        return None
    last = ids[-1]
    if last in request.stop_ids:
        request.stop_reason = None if last in request.eos_token_ids else last
        return _STOPPED
    return None


def append_and_check(
    request: Request, new_ids: list[int], max_model_len: int
) -> tuple[list[int], RequestStatus | None]:
    """Append sampled tokens one by one until a stop; returns the tokens kept.

    The common case (one token per step) costs one append and one check.
    """
    if len(new_ids) == 1:
        request.append_output_token_ids(new_ids)
        return new_ids, check_token_stop(request, max_model_len)
    for k, tok in enumerate(new_ids):
        request.append_output_token_ids([tok])
        status = check_token_stop(request, max_model_len)
        if status is not None:
            return new_ids[: k + 1], status
    return new_ids, None

