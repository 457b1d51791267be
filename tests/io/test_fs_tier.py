"""Shared-filesystem tier: two stores (two "hosts") over one directory,
the disk format, write-if-absent, corruption."""

from __future__ import annotations

from io_helpers import IDENT, get_ids, key, put_pattern

from kvstrata.io import TierSpec


def fs_spec(path) -> TierSpec:
    return TierSpec(type="fs", name="shared", options=dict(
        path=str(path), health=dict(retry_interval_s=0.05, max_retry_interval_s=0.1)))


async def test_a_chunk_stored_by_one_host_is_read_by_another(make_store, tmp_path):
    a = await make_store(tiers=[fs_spec(tmp_path / "nfs")])
    b = await make_store(tiers=[fs_spec(tmp_path / "nfs")])
    for i in (0, 1):
        put_pattern(a, i)
    await a.drain()
    assert await b.lookup([key(0), key(1), key(2)]) == 2
    assert await get_ids(b, [0, 1]) == [0, 1]
    s = b.stats().tier("shared")
    assert (s.kind, s.hit_chunks, s.bytes_out) == ("fs", 2, 2 * 8192)
    assert len(list((tmp_path / "nfs" / IDENT).glob("*.kvs"))) == 2


async def test_a_put_of_a_chunk_another_host_wrote_is_skipped(make_store, tmp_path):
    a = await make_store(tiers=[fs_spec(tmp_path / "nfs")])
    b = await make_store(tiers=[fs_spec(tmp_path / "nfs")])
    put_pattern(a, 0)
    await a.drain()
    put_pattern(b, 0)
    await b.drain()
    assert a.stats().tier("shared").puts == 1 and b.stats().tier("shared").puts == 0


async def test_corrupt_files_are_counted_misses_and_removed(make_store, tmp_path):
    a = await make_store(tiers=[fs_spec(tmp_path / "nfs")])
    b = await make_store(tiers=[fs_spec(tmp_path / "nfs")])
    for i in (0, 1):
        put_pattern(a, i)
    await a.drain()
    d = tmp_path / "nfs" / IDENT
    f0 = d / f"{key(0).name}.kvs"
    raw = bytearray(f0.read_bytes())
    raw[-1] ^= 0x80
    f0.write_bytes(bytes(raw))
    (d / f"{key(1).name}.kvs").write_bytes(b"KVSTRATA but not really")
    assert await b.lookup([key(1)]) == 0  # bad header: found at lookup
    assert await get_ids(b, [0]) == []  # bad payload: found at read
    await b.drain()
    assert b.stats().tier("shared").corrupt == 2
    assert not list(d.glob("*.kvs"))


async def test_fs_tier_recovers_after_its_root_reappears(make_store, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"x")  # the root path is a file: every operation fails
    store = await make_store(tiers=[fs_spec(blocker / "nfs")])
    put_pattern(store, 0)
    await store.drain()
    s = store.stats().tier("shared")
    assert not s.available and s.dropped_puts + s.faults >= 1
    assert await get_ids(store, [0]) == [0]
