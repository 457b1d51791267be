"""A real Redis Cluster on loopback for tests: N ``redis-server
--cluster-enabled yes`` processes joined with ``redis-cli --cluster create``.

No persistence; ``cluster-require-full-coverage no`` so that when one master
is killed the slots of the others keep serving (the store then sees misses
for the dead master's keys, which is what the tier's fault tests need).
"""

from __future__ import annotations

import random
import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

from redis.crc import key_slot


REDIS_BIN = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def _cluster_port() -> int:
    """A free loopback port whose cluster-bus port (port + 10000) is free too."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


def self_signed_cert(workdir: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (which no system CA store
    trusts) and its key, made with the openssl CLI."""
    crt, pem = workdir / "tls.crt", workdir / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(pem), "-out", str(crt)],
                   check=True, capture_output=True)
    return crt, pem


def _ping(port: int, ca: Path | None = None) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as raw:
            s = ssl.create_default_context(cafile=str(ca)).wrap_socket(raw, server_hostname="127.0.0.1") if ca \
                else raw
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisClusterProcs:
    """``masters`` redis-server processes forming one cluster (no replicas).
    With ``tls`` (a certificate and its key): TLS only, clients and the
    cluster bus alike, the certificate being its own CA."""

    def __init__(self, workdir: Path, masters: int = 3, tls: tuple[Path, Path] | None = None) -> None:
        if REDIS_BIN is None or REDIS_CLI is None:
            raise RuntimeError("redis-server and redis-cli are needed for a Redis Cluster")
        self.workdir = workdir
        self.tls = tls
        self.ports = [_cluster_port() for _ in range(masters)]
        self.procs: dict[int, subprocess.Popen] = {}

    def _spawn(self, port: int) -> None:
        d = self.workdir / f"node-{port}"
        d.mkdir(parents=True, exist_ok=True)
        if self.tls:
            crt, key = self.tls
            listen = ["--port", "0", "--tls-port", str(port), "--tls-cluster", "yes", "--tls-cert-file", str(crt),
                      "--tls-key-file", str(key), "--tls-ca-cert-file", str(crt), "--tls-auth-clients", "no"]
        else:
            listen = ["--port", str(port)]
        self.procs[port] = subprocess.Popen(
            [REDIS_BIN, "--bind", "127.0.0.1", *listen, "--save", "", "--appendonly", "no",
             "--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
             "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no",
             "--dir", str(d)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def _wait_up(self, port: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not _ping(port, self.tls[0] if self.tls else None):
            if time.monotonic() > deadline or self.procs[port].poll() is not None:
                raise RuntimeError(f"redis-server on port {port} did not start")
            time.sleep(0.02)

    def _cli(self, *args: str, port: int | None = None) -> str:
        cmd = [REDIS_CLI]
        if self.tls:
            cmd += ["--tls", "--cacert", str(self.tls[0])]
        if port is not None:
            cmd += ["-p", str(port)]
        out = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)} failed: {out.stderr or out.stdout}")
        return out.stdout

    def start(self) -> None:
        for p in self.ports:
            self._spawn(p)
        for p in self.ports:
            self._wait_up(p)
        self._cli("--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                  "--cluster-replicas", "0", "--cluster-yes")
        self.wait_ok()

    def wait_ok(self, timeout: float = 20.0) -> None:
        """Until every live node reports cluster_state:ok."""
        deadline = time.monotonic() + timeout
        while True:
            live = [p for p in self.ports if p in self.procs]
            states = [self._cli("cluster", "info", port=p) for p in live]
            if all("cluster_state:ok" in s for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster never became ok: {states}")
            time.sleep(0.1)

    def kill(self, port: int) -> None:
        """SIGKILL one master (its slots become unreachable)."""
        if port not in self.procs:  # seen once as a bare KeyError: name what was asked and what runs
            raise RuntimeError(f"no running master on port {port}: running {sorted(self.procs)}, "
                               f"cluster ports {self.ports}")
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait()

    def restart(self, port: int) -> None:
        """Start a killed master again from its nodes.conf (same node id, same slots)."""
        self._spawn(port)
        self._wait_up(port)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.ports]

    def master_of(self, key: bytes) -> int:
        """The port of the master that owns ``key``'s slot."""
        slot = key_slot(key)
        for line in self._cli("cluster", "nodes", port=next(iter(self.procs))).splitlines():
            parts = line.split()
            if "master" not in parts[2]:
                continue
            port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
            for rng in parts[8:]:
                if rng.startswith("["):
                    continue
                lo, _, hi = rng.partition("-")
                if int(lo) <= slot <= int(hi or lo):
                    return port
        raise RuntimeError(f"no master owns slot {slot} (cluster ports {self.ports})")


def require_cluster_binaries() -> None:
    """Skip a test without redis-server / redis-cli; fail it instead under
    KVSTRATA_REQUIRE_REDIS=1 (CI: the Redis tests must run)."""
    import os

    import pytest

    if REDIS_BIN is None or REDIS_CLI is None:
        if os.environ.get("KVSTRATA_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server / redis-cli not found and KVSTRATA_REQUIRE_REDIS=1")
        pytest.skip("needs redis-server and redis-cli")


def started_cluster(workdir: Path, *, tls: bool = False):
    """A started cluster for a module fixture (``yield from``), stopped after;
    with ``tls``, TLS only, with a self-signed certificate (``c.tls[0]``)."""
    require_cluster_binaries()
    if tls and shutil.which("openssl") is None:
        import pytest

        pytest.skip("openssl not installed")
    c = RedisClusterProcs(workdir, tls=self_signed_cert(workdir) if tls else None)
    try:
        c.start()
        yield c
    finally:
        c.stop()
