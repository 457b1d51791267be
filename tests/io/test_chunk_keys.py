"""Chunk keys: identity fingerprints, the keyer over a block-hash chain,
partial chunks, per-layer keys, validation."""

from __future__ import annotations

import msgspec
import pytest

from kvstrata.io import ALL_LAYERS, ChunkKey, ChunkKeyer, ChunkSpan, StoreIdentity

IDENTITY = StoreIdentity(model_fingerprint="m1", kv_dtype="float16", kv_layout="per_layer",
                         block_size=16, hash_algo="sha256", chunk_size=64)
HASHES = [bytes([i]) * 32 for i in range(10)]  # 10 full blocks = 160 tokens


def test_fingerprint_is_stable_and_covers_every_field():
    fp = IDENTITY.fingerprint()
    assert fp == StoreIdentity(model_fingerprint="m1", kv_dtype="float16", kv_layout="per_layer",
                               block_size=16, hash_algo="sha256", chunk_size=64).fingerprint()
    assert len(fp) == 32 and int(fp, 16) >= 0
    changes = dict(model_fingerprint="m2", kv_dtype="bfloat16", kv_layout="cross_layer",
                   block_size=32, hash_algo="xxhash", namespace="tenant", chunk_size=128)
    others = {msgspec.structs.replace(IDENTITY, **{k: v}).fingerprint() for k, v in changes.items()}
    assert len(others) == len(changes) and fp not in others


def test_chunk_size_must_be_a_multiple_of_block_size():
    with pytest.raises(ValueError, match="identity.chunk_size"):
        StoreIdentity(model_fingerprint="m", kv_dtype="f", kv_layout="l", block_size=16,
                      hash_algo="sha256", chunk_size=100)


def test_keys_take_the_hash_of_each_chunks_last_block():
    keyer = ChunkKeyer(IDENTITY)
    spans = keyer.spans(HASHES)
    fp = IDENTITY.fingerprint()
    assert spans == [
        ChunkSpan(ChunkKey(fp, HASHES[3], 64), 0, 64),
        ChunkSpan(ChunkKey(fp, HASHES[7], 64), 64, 128),
    ]
    assert keyer.keys(HASHES) == [s.key for s in spans]


def test_partial_last_chunk_only_when_configured():
    fp = IDENTITY.fingerprint()
    assert len(ChunkKeyer(IDENTITY).keys(HASHES)) == 2
    spans = ChunkKeyer(IDENTITY, save_partial=True).spans(HASHES)
    assert spans[-1] == ChunkSpan(ChunkKey(fp, HASHES[9], 32), 128, 160)
    assert len(spans) == 3
    # exactly chunk aligned: no partial chunk to add
    assert len(ChunkKeyer(IDENTITY, save_partial=True).keys(HASHES[:8])) == 2


def test_start_chunk_skips_leading_chunks():
    keyer = ChunkKeyer(IDENTITY, save_partial=True)
    assert [s.start for s in keyer.spans(HASHES, start_chunk=1)] == [64, 128]
    assert keyer.spans(HASHES[:3]) == [ChunkSpan(ChunkKey(keyer.fingerprint, HASHES[2], 48), 0, 48)]
    with pytest.raises(ValueError, match="start_chunk"):
        keyer.spans(HASHES, start_chunk=-1)


def test_a_longer_prompt_shares_the_keys_of_its_prefix():
    keyer = ChunkKeyer(IDENTITY)
    longer = HASHES + [b"\xff" * 32] * 6
    assert keyer.keys(longer)[:2] == keyer.keys(HASHES)


def test_layer_keys_and_names():
    k = ChunkKey("abc", b"\x01\x02", 256)
    assert k.layer == ALL_LAYERS and k.name == "0102"
    layers = k.layer_keys(3)
    assert [lk.layer for lk in layers] == [0, 1, 2]
    assert [lk.name for lk in layers] == ["0102.L0", "0102.L1", "0102.L2"]
    assert len({k, *layers}) == 4
    assert layers[1].chunk_key() == k and k.for_layer(1) == layers[1]
    with pytest.raises(ValueError, match="num_layers"):
        k.layer_keys(0)


def test_keys_are_hashable_values_and_survive_msgpack():
    k = ChunkKey("abc", b"\x01" * 32, 200, 4)
    assert k == ChunkKey("abc", b"\x01" * 32, 200, 4)
    assert {k: 1}[ChunkKey("abc", b"\x01" * 32, 200, 4)] == 1
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(k), type=ChunkKey) == k


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("../etc", b"\x01", 1), "key.identity"),
        (("", b"\x01", 1), "key.identity"),
        (("abc", b"", 1), "key.prefix_hash"),
        (("abc", b"\x01", 0), "key.num_tokens"),
        (("abc", b"\x01", 1, -2), "key.layer"),
    ],
)
def test_bad_keys_name_the_field(args, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ChunkKey(*args)


def test_keyer_rejects_a_non_identity():
    with pytest.raises(TypeError, match="identity"):
        ChunkKeyer("abc")  # type: ignore[arg-type]
