"""Request: the KVRequest protocol, incremental block hashes, statuses."""

from __future__ import annotations

import pytest
from engine_fakes import hasher_for

from kvstrata.enginecore.request import FINISH_REASONS, Request, RequestStatus
from kvstrata.types import SamplingParams
from kvstrata.kv import KVRequest


def make(tokens, *, bs=4, **kw) -> Request:
    return Request("r", tokens, SamplingParams(max_tokens=8), eos_token_ids=(1,),
                   block_hasher=hasher_for(bs), hash_block_size=bs, **kw)


def test_is_a_kv_request_with_slots():
    req = make([5, 6, 7])
    assert isinstance(req, KVRequest)
    assert not hasattr(req, "__dict__")
    assert (req.num_tokens, req.num_prompt_tokens, req.num_computed_tokens) == (3, 3, 0)
    assert req.mm_features == [] and req.prompt_embeds_digest is None


def test_block_hashes_grow_as_blocks_fill():
    req = make(list(range(10, 17)))
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([50])
    assert len(req.block_hashes) == 2
    for tok in range(51, 54):
        req.append_output_token_ids([tok])
        assert len(req.block_hashes) == 2
    req.append_output_token_ids([54])
    assert len(req.block_hashes) == 3
    # Same chain as hashing all the tokens at once.
    assert req.block_hashes == make(req.all_token_ids).block_hashes


def test_cache_salt_and_lora_change_the_hashes():
    tokens = list(range(10, 18))
    plain = make(tokens).block_hashes
    assert make(tokens, cache_salt="tenant-a").block_hashes[0] != plain[0]
    assert make(tokens, lora_name="adapter").block_hashes[1] != plain[1]


def test_without_a_hasher_no_hashes_are_kept():
    req = Request("r", [1, 2, 3, 4, 5], SamplingParams())
    req.append_output_token_ids([6, 7, 8])
    assert req.block_hashes == [] and req.output_token_ids == [6, 7, 8]


def test_stop_ids_cover_eos_unless_ignored():
    assert make([3]).stop_ids == {1}
    assert Request("r", [3], SamplingParams(ignore_eos=True, stop_token_ids=[9]), eos_token_ids=(1,)).stop_ids == {9}
    assert Request("r", [3], SamplingParams(), eos_token_ids=(1, 2)).stop_ids == {1, 2}


def test_statuses_order_and_finish_reasons():
    unfinished = [RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS,
                  RequestStatus.RUNNING, RequestStatus.PREEMPTED]
    assert not any(s.is_finished for s in unfinished)
    assert [FINISH_REASONS[s] for s in RequestStatus if s.is_finished] == ["stop", "length", "abort", "error"]
    req = make([3])
    req.status = RequestStatus.FINISHED_LENGTH
    assert req.is_finished and req.finish_reason == "length"


def test_hasher_needs_a_block_size():
    with pytest.raises(ValueError, match="hash_block_size"):
        Request("r", [3], SamplingParams(), block_hasher=hasher_for(4))
