"""Block hashing: canonical encodings, deterministic roots, extra keys."""

import hashlib
import os
import subprocess
import sys
import textwrap

import cbor2
import pytest
import xxhash

from kvstrata.kv import (
    HASH_ALGOS,
    MultiModalFeature,
    UnknownHashAlgorithmError,
    get_hash_fn,
    make_block_hasher,
    root_hash,
)

from .builders import TestRequest, make_hasher, make_identity, make_request


def test_hash_functions_have_their_digest_sizes():
    assert [(n, get_hash_fn(n).digest_size) for n in HASH_ALGOS] == [
        ("sha256", 32),
        ("sha256_cbor", 32),
        ("xxhash", 16),
        ("xxhash_cbor", 16),
    ]


def test_sha256_hashes_the_canonical_byte_encoding():
    fn = get_hash_fn("sha256")
    parent = bytes(range(32))
    expected_bytes = parent + (2).to_bytes(4, "little") + (7).to_bytes(4, "little") + (300).to_bytes(4, "little")
    assert fn.encode(parent, [7, 300], None) == expected_bytes
    assert fn.hash_block(parent, [7, 300]) == hashlib.sha256(expected_bytes).digest()


def test_extra_keys_are_length_prefixed_tlvs():
    fn = get_hash_fn("xxhash")
    parent = b"\x01" * 16
    extra = (("lora", "ab"), ("mm", "img", 5), ("salt", "s"), ("embeds", b"\xff"))
    tail = b"L" + (2).to_bytes(4, "little") + b"ab"
    tail += b"M" + (3).to_bytes(4, "little") + b"img" + (5).to_bytes(8, "little")
    tail += b"S" + (1).to_bytes(4, "little") + b"s"
    tail += b"E" + (1).to_bytes(4, "little") + b"\xff"
    data = parent + (1).to_bytes(4, "little") + (9).to_bytes(4, "little") + tail
    assert fn.encode(parent, [9], extra) == data
    assert fn.hash_block(parent, [9], extra) == xxhash.xxh3_128_digest(data)


def test_cbor_variant_hashes_canonical_cbor():
    fn = get_hash_fn("sha256_cbor")
    parent = b"\x02" * 32
    data = fn.encode(parent, [1, 2], (("lora", "x"),))
    assert cbor2.loads(data) == [parent, [1, 2], [["lora", "x"]]]
    assert data == cbor2.dumps([parent, [1, 2], [["lora", "x"]]], canonical=True)
    assert fn.hash_block(parent, [1, 2], (("lora", "x"),)) == hashlib.sha256(data).digest()


def test_unknown_hash_algorithm_names_the_choices():
    with pytest.raises(UnknownHashAlgorithmError, match="hash_algo must be one of sha256, sha256_cbor"):
        get_hash_fn("md5")
    with pytest.raises(ValueError, match="'md5'"):
        make_identity(hash_algo="md5")


@pytest.mark.parametrize(
    "field, value",
    [("block_size", 0), ("block_size", -16), ("model_fingerprint", ""), ("kv_dtype", 3), ("namespace", 5)],
)
def test_bad_identity_fields_are_named(field, value):
    with pytest.raises(ValueError, match=f"CacheIdentity.{field}"):
        make_identity(**{field: value})


def test_root_depends_on_every_identity_field():
    base = make_identity()
    roots = {root_hash(base)}
    for change in (
        {"model_fingerprint": "other-weights"},
        {"kv_dtype": "bfloat16"},
        {"kv_layout": "cross_layer"},
        {"block_size": 32},
        {"hash_algo": "sha256_cbor"},
        {"namespace": "tenant-a"},
    ):
        roots.add(root_hash(make_identity(**{**{"block_size": 16}, **change})))
    assert len(roots) == 7
    assert root_hash(make_identity()) == root_hash(base)


def test_random_root_only_on_request():
    identity = make_identity()
    assert make_block_hasher(identity).root == root_hash(identity)
    r1 = make_block_hasher(identity, random_root=True).root
    r2 = make_block_hasher(identity, random_root=True).root
    assert len(r1) == 32 and r1 != r2 and r1 != root_hash(identity)


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_hasher_chains_full_blocks_from_the_root(algo):
    hasher = make_hasher(4, algo)
    fn = get_hash_fn(algo)
    req = TestRequest("r", range(10), hasher)
    h0 = fn.hash_block(hasher.root, [0, 1, 2, 3])
    h1 = fn.hash_block(h0, [4, 5, 6, 7])
    assert req.block_hashes == [h0, h1]


def test_hashes_grow_incrementally_as_tokens_are_appended():
    hasher = make_hasher(4)
    grown = TestRequest("a", range(3), hasher)
    assert grown.block_hashes == []
    for t in range(3, 13):
        grown.append_output_token_ids([t])
    whole = TestRequest("b", range(13), hasher)
    assert len(grown.block_hashes) == 3
    assert grown.block_hashes == whole.block_hashes
    assert hasher(grown) == []


def test_same_prefix_same_hashes_different_tokens_diverge():
    hasher = make_hasher(4)
    a = TestRequest("a", [1, 2, 3, 4, 5, 6, 7, 8], hasher)
    b = TestRequest("b", [1, 2, 3, 4, 5, 6, 7, 9], hasher)
    assert a.block_hashes[0] == b.block_hashes[0]
    assert a.block_hashes[1] != b.block_hashes[1]


def test_lora_name_changes_every_block():
    hasher = make_hasher(4)
    plain = TestRequest("a", range(8), hasher)
    lora = TestRequest("b", range(8), hasher, lora_name="sql")
    assert all(x != y for x, y in zip(plain.block_hashes, lora.block_hashes))
    fn = get_hash_fn("sha256")
    assert lora.block_hashes[0] == fn.hash_block(hasher.root, [0, 1, 2, 3], (("lora", "sql"),))


def test_cache_salt_enters_only_the_first_block():
    hasher = make_hasher(4)
    fn = get_hash_fn("sha256")
    salted = TestRequest("s", range(8), hasher, cache_salt="tenant")
    h0 = fn.hash_block(hasher.root, [0, 1, 2, 3], (("salt", "tenant"),))
    h1 = fn.hash_block(h0, [4, 5, 6, 7], None)
    assert salted.block_hashes == [h0, h1]


def test_multimodal_items_key_every_block_they_overlap():
    hasher = make_hasher(4)
    fn = get_hash_fn("sha256")
    features = [MultiModalFeature(identifier="imgA", offset=2, length=3), MultiModalFeature(identifier="imgB", offset=9, length=2)]
    req = TestRequest("m", range(12), hasher, mm_features=features)
    h0 = fn.hash_block(hasher.root, [0, 1, 2, 3], (("mm", "imgA", 2),))
    h1 = fn.hash_block(h0, [4, 5, 6, 7], (("mm", "imgA", 2),))
    h2 = fn.hash_block(h1, [8, 9, 10, 11], (("mm", "imgB", 9),))
    assert req.block_hashes == [h0, h1, h2]
    other_image = TestRequest("n", range(12), hasher, mm_features=[MultiModalFeature(identifier="imgZ", offset=2, length=3), features[1]])
    assert other_image.block_hashes[0] != h0


def test_prompt_embeds_digest_keys_prompt_blocks_only():
    hasher = make_hasher(4)
    fn = get_hash_fn("sha256")
    req = TestRequest("e", range(6), hasher, prompt_embeds_digest=b"\xaa" * 8)
    req.append_output_token_ids([6, 7])
    h0 = fn.hash_block(hasher.root, [0, 1, 2, 3], (("embeds", b"\xaa" * 8),))
    h1 = fn.hash_block(h0, [4, 5, 6, 7], (("embeds", b"\xaa" * 8),))  # starts inside the prompt
    assert req.block_hashes == [h0, h1]
    req.append_output_token_ids([8, 9, 10, 11])
    assert req.block_hashes[2] == fn.hash_block(h1, [8, 9, 10, 11], None)


def test_empty_token_list_is_rejected_by_name():
    with pytest.raises(ValueError, match="request 'x': all_token_ids must not be empty"):
        make_request("x", [], block_size=4)


def test_negative_token_id_is_rejected_by_name():
    with pytest.raises(ValueError, match="all_token_ids must hold integers"):
        make_request("x", [1, -2, 3, 4], block_size=4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lora_name": ""}, "lora_name must be a non-empty str"),
        ({"lora_name": 7}, "lora_name must be a non-empty str"),
        ({"cache_salt": b"x"}, "cache_salt must be a non-empty str"),
        ({"prompt_embeds_digest": "abc"}, "prompt_embeds_digest must be non-empty bytes"),
        ({"mm_features": [("img", 0, 2)]}, r"mm_features\[0\] must be a MultiModalFeature"),
        ({"mm_features": [MultiModalFeature(identifier="", offset=0, length=1)]}, r"mm_features\[0\].identifier"),
        ({"mm_features": [MultiModalFeature(identifier="i", offset=-1, length=1)]}, r"mm_features\[0\].offset"),
        ({"mm_features": [MultiModalFeature(identifier="i", offset=0, length=0)]}, r"mm_features\[0\].length"),
        (
            {"mm_features": [MultiModalFeature(identifier="i", offset=4, length=1), MultiModalFeature(identifier="j", offset=1, length=1)]},
            "sorted by offset",
        ),
    ],
)
def test_malformed_extra_keys_are_named(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make_request("bad", range(8), block_size=4, **kwargs)


_CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    from kvstrata.kv import CacheIdentity, make_block_hasher
    from tests.kv.builders import TestRequest
    hasher = make_block_hasher(CacheIdentity(model_fingerprint="m", kv_dtype="float32",
                                             kv_layout="per_layer", block_size=16))
    for prompt in ([*range(100)], [7] * 40, [*range(1000, 1064)]):
        req = TestRequest("r", prompt, hasher, cache_salt="s", lora_name="l")
        print(",".join(h.hex() for h in req.block_hashes))
    print(hash("not-deterministic-across-seeds"))
    """
)


def test_two_processes_with_different_hash_seeds_agree():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    outputs = []
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD.format(root=root)], capture_output=True, text=True, env=env, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout.splitlines())
    block_lines = [lines[:3] for lines in outputs]
    assert block_lines[0] == block_lines[1]
    assert [len(line.split(",")) for line in block_lines[0]] == [6, 2, 4]
    assert outputs[0][3] != outputs[1][3]  # the seeds really differed
