"""Where the engine subprocess listens.

``ipc://`` (the default) lives in a fresh private directory (mode 0700) so that
only this user can open the socket; ``tcp://`` binds to loopback only.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from dataclasses import dataclass

_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


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
        d = tempfile.mkdtemp(prefix="kvstrata-")
        os.chmod(d, 0o700)
        return EngineAddress(url=f"ipc://{d}/engine.sock", private_dir=d)
    if transport == "tcp":
        if port == 0:
            port = free_port()
        return EngineAddress(url=f"tcp://127.0.0.1:{port}")
    raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")


def check_address(url: str) -> str:
    """Validate an address given by the user: ipc:// path, or tcp:// on loopback."""
    if url.startswith("ipc://"):
        if len(url) <= len("ipc://"):
            raise ValueError("address: ipc:// needs a socket path")
        return url
    if url.startswith("tcp://"):
        host, _, port = url[len("tcp://"):].rpartition(":")
        if host not in _LOOPBACK:
            raise ValueError(f"address: tcp host must be loopback (127.0.0.1), got {host!r}")
        if not port.isdigit():
            raise ValueError(f"address: tcp port must be a number, got {port!r}")
        return url
    raise ValueError(f"address must start with ipc:// or tcp://, got {url!r}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
