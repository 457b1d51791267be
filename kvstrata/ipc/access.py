"""Who may talk to an engine: the access checks of the engine server's
ROUTER socket (``kvstrata.ipc.engine_server``).

    ipc://  the peer's uid (SO_PEERCRED on the connection's fd) must be the
            engine's own, besides the socket's 0700 directory
    tcp://  a ZMQ CURVE server whose ZAP handler admits only the owner's
            client key; any other peer gets no answer at all
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import struct
from typing import TYPE_CHECKING

import structlog
import zmq
import zmq.utils.z85

from kvstrata.ipc import protocol as P

if TYPE_CHECKING:  # imported where it is used: only tcp:// engines start one
    from zmq.auth.thread import ThreadAuthenticator

log = structlog.get_logger(__name__)


def peer_uid(fd: int) -> int:
    """The uid of the process at the other end of a unix socket (-1: unknown)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            _pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                               struct.calcsize("3i")))
            return uid
    except OSError:
        return -1


def curve_server(sock: zmq.Socket, credentials: P.Credentials) -> ThreadAuthenticator:
    """Make ``sock`` a CURVE server that admits only the owner's client key
    (a ZAP handler thread decides); a peer without it gets nothing at all,
    not even a handshake answer."""
    from zmq.auth.thread import ThreadAuthenticator

    if not credentials.curve or credentials.client_public is None:
        raise ValueError("an engine on tcp:// needs CURVE keys in its credentials")
    allowed = credentials.client_public.encode()

    class _OwnerKeys:
        def callback(self, domain: str, key: bytes) -> bool:
            ok = hmac.compare_digest(zmq.utils.z85.encode(key) if len(key) == 32 else key, allowed)
            if not ok:
                log.warning("engine_client_refused", reason="unknown CURVE key")
            return ok

    auth = ThreadAuthenticator(zmq.Context.instance(), log=_zap_log)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_OwnerKeys())
    sock.curve_server = True
    sock.curve_secretkey = credentials.server_secret.encode()  # type: ignore[union-attr]
    sock.curve_publickey = credentials.server_public.encode()  # type: ignore[union-attr]
    return auth


_zap_log = logging.getLogger("kvstrata.ipc.zap")
_zap_log.setLevel(logging.WARNING)
