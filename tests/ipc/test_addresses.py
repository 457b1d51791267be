"""Stale ipc:// directories left by killed servers are cleaned at start;
live ones, other users' names and engines still starting are kept."""

from __future__ import annotations

import os
import socket
import time

from kvstrata.ipc.addresses import make_address, remove_stale_dirs


def _dir_with_socket(parent, name, *, listening: bool):
    d = parent / name
    d.mkdir(mode=0o700)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(d / "engine.sock"))
    if listening:
        s.listen(1)
        return d, s
    s.close()  # the socket file stays, nobody listens: what a SIGKILL leaves
    return d, None


def test_a_socket_nobody_listens_on_is_removed_and_a_live_one_kept(tmp_path):
    dead, _ = _dir_with_socket(tmp_path, "kvstrata-dead", listening=False)
    live, sock = _dir_with_socket(tmp_path, "kvstrata-live", listening=True)
    other, _ = _dir_with_socket(tmp_path, "someone-else", listening=False)
    try:
        assert remove_stale_dirs(str(tmp_path)) == [str(dead)]
        assert not dead.exists() and live.exists() and other.exists()
    finally:
        sock.close()


def test_a_directory_without_a_socket_is_kept_while_young(tmp_path):
    young = tmp_path / "kvstrata-starting"
    young.mkdir()
    old = tmp_path / "kvstrata-abandoned"
    old.mkdir()
    past = time.time() - 3600
    os.utime(old, (past, past))
    assert remove_stale_dirs(str(tmp_path)) == [str(old)]
    assert young.exists()


def test_make_address_cleans_stale_dirs_first(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    dead, _ = _dir_with_socket(tmp_path, "kvstrata-dead", listening=False)
    addr = make_address("ipc")
    try:
        assert not dead.exists()
        assert addr.private_dir is not None and addr.private_dir.startswith(str(tmp_path))
        assert oct(os.stat(addr.private_dir).st_mode & 0o777) == "0o700"
    finally:
        addr.cleanup()
