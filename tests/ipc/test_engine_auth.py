"""Who may talk to an engine: over tcp:// only clients holding the owner's
CURVE keys get anything at all (a plain peer or a wrong key gets no answer,
not even to a handshake); only the owner may shut the engine down (over ipc
too); the credentials reach the engine through its stdin, never argv."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import zmq

from kvstrata.ipc import protocol as P
from kvstrata.ipc.mp_client import MPEngineClient
from kvstrata.types import SamplingParams

from tests.serve.serve_helpers import null_config

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


async def _generate(client) -> list[int]:
    return [t async for o in client.generate([1, 2, 3], PARAMS) for t in o.new_token_ids]


def _raw_handshake(address: str, *, curve: tuple[bytes, bytes, bytes] | None, wait_ms: int = 1500) -> bytes | None:
    """A hand-made DEALER (optionally CURVE with the given server key and
    client keypair) asks for the handshake; returns the reply or None."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if curve is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
        sock.connect(address)
        sock.send(msgspec.msgpack.encode(P.Utility(1, P.Handshake())))
        if sock.poll(wait_ms):
            return sock.recv()
        return None
    finally:
        sock.close()


@pytest.fixture
async def tcp_owner():
    owner = await MPEngineClient.start(null_config(), transport="tcp")
    try:
        yield owner
    finally:
        await owner.aclose()


async def test_unauthenticated_tcp_peers_get_nothing(tcp_owner):
    owner = tcp_owner
    creds = owner.credentials
    assert creds is not None and creds.curve
    # the right key gets its answer (the test can tell an answer from silence)
    right = (creds.server_public.encode(), creds.client_public.encode(), creds.client_secret.encode())
    assert await asyncio.to_thread(_raw_handshake, owner.address, curve=right) is not None
    # a plain ZMQ peer (NULL security) and a CURVE peer with its own key: silence
    assert await asyncio.to_thread(_raw_handshake, owner.address, curve=None) is None
    pub, sec = zmq.curve_keypair()
    wrong = (creds.server_public.encode(), pub, sec)
    assert await asyncio.to_thread(_raw_handshake, owner.address, curve=wrong) is None
    assert await _generate(owner) == await _generate(owner)  # the owner is served throughout
    health = await owner.health()
    assert health.num_requests == 0


async def test_a_client_without_keys_cannot_even_connect_over_tcp(tcp_owner):
    with pytest.raises(ValueError, match="CURVE credentials"):
        await MPEngineClient.connect(tcp_owner.address)


async def test_only_the_owner_may_shut_the_engine_down(tcp_owner):
    owner = tcp_owner
    other = await MPEngineClient.connect(owner.address, credentials=owner.credentials.for_client())
    try:
        assert other.credentials.owner_token == ""
        await other.shutdown_engine()
        await asyncio.sleep(0.3)
        assert not owner.is_dead and not other.is_dead
        assert len(await _generate(other)) == 3 and len(await _generate(owner)) == 3
        assert (await owner.health()).num_protocol_errors >= 1  # the refused shutdown
        await owner.shutdown_engine()
        async with asyncio.timeout(10):
            while not other.is_dead:
                await asyncio.sleep(0.05)
    finally:
        await other.aclose()


async def test_over_ipc_a_second_client_cannot_shut_the_engine_down():
    owner = await MPEngineClient.start(null_config(), transport="ipc")
    try:
        other = await MPEngineClient.connect(owner.address)
        try:
            await other.shutdown_engine()
            await asyncio.sleep(0.3)
            assert not owner.is_dead and len(await _generate(other)) == 3
        finally:
            await other.aclose()
    finally:
        await owner.aclose()


async def test_credentials_never_appear_in_the_engine_command_line(tcp_owner):
    creds = tcp_owner.credentials
    cmdline = Path(f"/proc/{tcp_owner._proc.pid}/cmdline").read_bytes()
    for secret in (creds.owner_token, creds.server_secret, creds.client_secret, creds.client_public):
        assert secret.encode() not in cmdline
_PROBE = """
import sys, zmq, msgspec
from kvstrata.ipc import protocol as P
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(sys.argv[1])
sock.send(msgspec.msgpack.encode(P.Utility(1, P.Handshake())))
print("ANSWER" if sock.poll(1500) else "SILENT")
"""


def _can_run_as(uid: int) -> bool:
    """Whether ``uid`` can run this environment's Python with zmq and kvstrata."""
    import subprocess
    import sys

    cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c",
           "import zmq, msgspec, kvstrata.ipc.protocol"]
    return subprocess.run(cmd, capture_output=True, timeout=30, cwd="/",
                          env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])}).returncode == 0


def _probe_as(uid: int, address: str) -> str:
    """Run the probe as ``uid`` (``setpriv``: a real process of that user)."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-c", _PROBE, address]
    if uid != os.getuid():
        cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd="/",
                         env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


async def test_over_ipc_a_peer_of_another_user_gets_nothing():
    """Even with the 0700 directory loosened (the first line of defence
    gone), the engine checks each connection's peer uid (SO_PEERCRED) before
    its first message and answers only its own user."""
    import os

    import shutil

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a probe as another user")
    if not _can_run_as(65534):
        pytest.skip("this checkout or its venv is not readable by another user (e.g. under a 0700 directory)")
    owner = await MPEngineClient.start(null_config(), transport="ipc")
    try:
        path = Path(owner.address[len("ipc://"):])
        path.parent.chmod(0o755)
        path.chmod(0o777)
        assert await asyncio.to_thread(_probe_as, os.getuid(), owner.address) == "ANSWER"
        assert await asyncio.to_thread(_probe_as, 65534, owner.address) == "SILENT"
        assert len(await _generate(owner)) == 3
    finally:
        await owner.aclose()


@pytest.mark.parametrize("same_user", [True, False], ids=["own-user", "other-user"])
async def test_the_ipc_peer_check_answers_only_the_allowed_uid(same_user):
    """The same check without a second user account: an in-process engine
    server told that its user is someone else refuses this process."""
    import os

    import msgspec
    import zmq.asyncio

    from kvstrata.enginecore.async_engine import AsyncEngine
    from kvstrata.ipc.addresses import make_address
    from kvstrata.ipc.engine_server import EngineServer

    addr = make_address("ipc")
    cfg = null_config()
    uid = os.getuid() if same_user else os.getuid() + 12345
    server = EngineServer(addr.url, msgspec.to_builtins(cfg), P.Credentials.new(curve=False), allowed_uid=uid)
    engine = await AsyncEngine.start(cfg)
    server.attach(engine)
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr.url)
        await sock.send(msgspec.msgpack.encode(P.Utility(1, P.Handshake())))
        answered = await sock.poll(1500)
        assert bool(answered) == same_user
    finally:
        sock.close()
        await server.close("test over")
        await engine.aclose()
        addr.cleanup()
