"""Where the engine subprocess listens.

``ipc://`` (the default) lives in a fresh private directory (mode 0700) so that
only this user can open the socket; ``tcp://`` binds to loopback only.

A server killed before it could remove its directory leaves it behind:
``make_address`` first removes this user's stale ones (a socket file that no
process listens on, or no socket at all after a grace period).
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
import time
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)

_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
_PREFIX = "kvstrata-"
_SOCKET = "engine.sock"
# A directory without a socket is someone's engine still starting, unless older.
_STARTING_GRACE_S = 600.0


@dataclass(frozen=True, slots=True)
class EngineAddress:
    """A bound address and the private directory to remove with it (ipc only)."""

    url: str
    private_dir: str | None = None

    def cleanup(self) -> None:
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)


def make_address(transport: str = "ipc", *, port: int = 0) -> EngineAddress:
    """A new address for an engine to bind: a socket file in a 0700 directory,
    or a loopback TCP port (``port=0`` picks a free one)."""
    if transport == "ipc":
        # mkdtemp creates the directory with mode 0700 already; chmod again so a
        # permissive umask can never widen it.
        remove_stale_dirs()
        d = tempfile.mkdtemp(prefix=_PREFIX)
        os.chmod(d, 0o700)
        return EngineAddress(url=f"ipc://{d}/{_SOCKET}", private_dir=d)
    if transport == "tcp":
        if port == 0:
            port = free_port()
        return EngineAddress(url=f"tcp://127.0.0.1:{port}")
    raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")


def check_address(url: str, *, allow_remote: bool = False) -> str:
    """Validate an address given by the user: ipc:// path, or tcp:// on
    loopback; any tcp host with ``allow_remote`` (the engine and its clients
    hold CURVE keys: ``kvstrata engine --listen``)."""
    if url.startswith("ipc://"):
        if len(url) <= len("ipc://"):
            raise ValueError("address: ipc:// needs a socket path")
        return url
    if url.startswith("tcp://"):
        host, _, port = url[len("tcp://"):].rpartition(":")
        if not host:
            raise ValueError(f"address: tcp:// needs HOST:PORT, got {url!r}")
        if host not in _LOOPBACK and not allow_remote:
            raise ValueError(f"address: tcp host must be loopback (127.0.0.1), got {host!r}")
        if not port.isdigit():
            raise ValueError(f"address: tcp port must be a number, got {port!r}")
        return url
    raise ValueError(f"address must start with ipc:// or tcp://, got {url!r}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def remove_stale_dirs(parent: str | None = None) -> list[str]:
    """Remove this user's ``kvstrata-*`` socket directories that no live
    engine listens in; returns the removed paths."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    uid = os.getuid()
    for e in entries:
        if not e.name.startswith(_PREFIX):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or not _is_stale(e.path, st.st_mtime):
            continue
        shutil.rmtree(e.path, ignore_errors=True)
        removed.append(e.path)
    if removed:
        log.info("stale_ipc_dirs_removed", count=len(removed))
    return removed


def _is_stale(path: str, mtime: float) -> bool:
    sock_path = os.path.join(path, _SOCKET)
    try:
        st = os.stat(sock_path, follow_symlinks=False)
    except FileNotFoundError:
        return time.time() - mtime > _STARTING_GRACE_S
    except OSError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(sock_path)
        except ConnectionRefusedError:
            return True  # the file outlived its listener
        except OSError:
            return False
    return False
