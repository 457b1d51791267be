"""Configuration of the tiered store: one small Struct per component.

``StoreConfig`` holds the L1 (CPU) section and an ordered list of lower tiers
(fastest first). A lower tier is a ``TierSpec``: a type (a registry name such
as ``"disk"``, or a dotted path to a class for user tiers), its write mode and
its own options, which the tier class decodes into its options Struct.
Bad values raise ValueError naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol, TypeVar

import msgspec

from kvstrata.io.policies import POLICIES

_STRUCT = dict(frozen=True, kw_only=True, forbid_unknown_fields=True)


class _Validating(Protocol):
    def validate(self, prefix: str) -> None: ...


_Options = TypeVar("_Options", bound=_Validating)  # a tier's options Struct


def check_int(name: str, value: object, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_float(name: str, value: object, minimum: float = 0.0) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= minimum:
        raise ValueError(f"{name} must be a number > {minimum}, got {value!r}")


def check_policy(name: str, value: str) -> None:
    if value not in POLICIES:
        raise ValueError(f"{name} must be one of {sorted(POLICIES)}, got {value!r}")


class CPUConfig(msgspec.Struct, **_STRUCT):
    """L1: host memory carved by an allocator. ``pin_memory=None`` pins the
    buffer when CUDA is present."""

    capacity_bytes: int = 1 << 30
    allocator: Literal["first_fit", "slots"] = "first_fit"
    slot_bytes: int | None = None
    policy: str = "lru"
    pin_memory: bool | None = None

    def validate(self, prefix: str = "cpu") -> None:
        check_int(f"{prefix}.capacity_bytes", self.capacity_bytes, 4096)
        check_policy(f"{prefix}.policy", self.policy)
        if self.allocator == "slots":
            if self.slot_bytes is None:
                raise ValueError(f"{prefix}.slot_bytes is required when {prefix}.allocator is 'slots'")
            check_int(f"{prefix}.slot_bytes", self.slot_bytes)
            if self.slot_bytes > self.capacity_bytes:
                raise ValueError(f"{prefix}.slot_bytes must be <= {prefix}.capacity_bytes")


class TierSpec(msgspec.Struct, **_STRUCT):
    """One lower tier. ``write="through"`` writes it on every put;
    ``"back"`` writes it when L1 evicts the object."""

    type: str
    name: str | None = None
    write: Literal["through", "back"] = "through"
    options: dict[str, Any] = msgspec.field(default_factory=dict)  # Any: TOML values, the tier's to decode
    # Caps the tier's read bandwidth (bytes/s; None: no cap): a slower
    # medium for benchmarks, or a link the tier shares.
    read_bandwidth_bps: float | None = None


class HealthConfig(msgspec.Struct, **_STRUCT):
    """How an unavailable tier is retried: first after ``retry_interval_s``,
    doubling up to ``max_retry_interval_s``."""

    retry_interval_s: float = 1.0
    max_retry_interval_s: float = 30.0


class DiskOptions(msgspec.Struct, **_STRUCT):
    path: str
    capacity_bytes: int
    policy: str = "lru"
    io_threads: int = 2
    max_queued_puts: int = 64
    use_odirect: bool = True
    fsync: bool = False
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)

    def validate(self, prefix: str) -> None:
        if not self.path:
            raise ValueError(f"{prefix}.path must be a non-empty path")
        check_int(f"{prefix}.capacity_bytes", self.capacity_bytes)
        check_policy(f"{prefix}.policy", self.policy)
        check_int(f"{prefix}.io_threads", self.io_threads)
        check_int(f"{prefix}.max_queued_puts", self.max_queued_puts, 0)
        _check_health(f"{prefix}.health", self.health)


class FSOptions(msgspec.Struct, **_STRUCT):
    """A filesystem shared by several processes or hosts (NFS, Lustre, ...):
    no local index, every lookup asks the filesystem."""

    path: str
    io_threads: int = 4
    max_queued_puts: int = 64
    use_odirect: bool = False
    fsync: bool = False
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)

    def validate(self, prefix: str) -> None:
        if not self.path:
            raise ValueError(f"{prefix}.path must be a non-empty path")
        check_int(f"{prefix}.io_threads", self.io_threads)
        check_int(f"{prefix}.max_queued_puts", self.max_queued_puts, 0)
        _check_health(f"{prefix}.health", self.health)


class RedisTLSOptions(msgspec.Struct, **_STRUCT):
    """TLS to Redis (a server, or every node of a cluster) with ``ssl``: the
    server's certificate is verified against ``ssl_ca_certs`` (else the
    system's CA store) and its host name (``ssl_check_hostname``);
    ``ssl_certfile`` and ``ssl_keyfile``: a client certificate.
    ``ssl_insecure_skip_verify`` accepts any certificate: test setups only."""

    ssl: bool = False
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_check_hostname: bool = True
    ssl_insecure_skip_verify: bool = False


class RedisOptions(RedisTLSOptions, **_STRUCT):
    """A Redis server through redis.asyncio. Keys are
    ``{key_prefix}:{identity}:{name}:{m|d}`` (metadata, data)."""

    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = None
    key_prefix: str = "kvstrata"
    ttl_s: int | None = None
    socket_timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    max_connections: int = 16
    max_in_flight: int = 8
    max_queued_puts: int = 64
    io_threads: int = 2
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)

    def validate(self, prefix: str) -> None:
        check_int(f"{prefix}.port", self.port)
        check_int(f"{prefix}.db", self.db, 0)
        _check_redis_common(prefix, self)


class RedisClusterOptions(RedisTLSOptions, **_STRUCT):
    """A Redis Cluster through redis.asyncio.cluster. ``startup_nodes`` are
    ``"host:port"`` strings (any reachable one is enough to discover the
    rest). Keys are ``{key_prefix}:{identity}:{{name}}:{m|d}``: the object's
    name is the hash tag, so its two keys live in one slot."""

    startup_nodes: tuple[str, ...]
    username: str | None = None
    password: str | None = None
    key_prefix: str = "kvstrata"
    ttl_s: int | None = None
    socket_timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    max_connections: int = 16  # per node
    max_in_flight: int = 8
    max_queued_puts: int = 64
    io_threads: int = 2
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)

    def validate(self, prefix: str) -> None:
        if not self.startup_nodes:
            raise ValueError(f"{prefix}.startup_nodes must name at least one \"host:port\"")
        for i, node in enumerate(self.startup_nodes):
            parse_host_port(f"{prefix}.startup_nodes[{i}]", node)
        if "{" in self.key_prefix or "}" in self.key_prefix:  # it would become the hash tag
            raise ValueError(f"{prefix}.key_prefix must contain no '{{' or '}}'")
        _check_redis_common(prefix, self)

    def nodes(self) -> list[tuple[str, int]]:
        return [parse_host_port("startup_nodes", n) for n in self.startup_nodes]


def parse_host_port(name: str, value: str) -> tuple[str, int]:
    """``"host:port"`` (``"[::1]:port"`` for IPv6) -> (host, port)."""
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name} must be \"host:port\" with a port in 1..65535, got {value!r}")
    return host, int(port)


def _check_redis_common(prefix: str, o: RedisOptions | RedisClusterOptions) -> None:
    """The fields the Redis and Redis Cluster options share."""
    if o.ssl_insecure_skip_verify and o.ssl_ca_certs:
        raise ValueError(f"{prefix}.ssl_insecure_skip_verify contradicts {prefix}.ssl_ca_certs: "
                         "a CA is given to verify against")
    if not o.ssl and (o.ssl_ca_certs or o.ssl_certfile or o.ssl_keyfile):
        raise ValueError(f"{prefix}.ssl is false but TLS files are given (ssl_ca_certs / ssl_certfile / "
                         "ssl_keyfile): set ssl = true to use them")
    if bool(o.ssl_certfile) != bool(o.ssl_keyfile):
        raise ValueError(f"{prefix}.ssl_certfile and {prefix}.ssl_keyfile go together (a client certificate "
                         "and its key)")
    if o.ttl_s is not None:
        check_int(f"{prefix}.ttl_s", o.ttl_s)
    if not o.key_prefix or ":" in o.key_prefix:
        raise ValueError(f"{prefix}.key_prefix must be non-empty and contain no ':'")
    check_float(f"{prefix}.socket_timeout_s", o.socket_timeout_s)
    check_float(f"{prefix}.connect_timeout_s", o.connect_timeout_s)
    check_int(f"{prefix}.max_connections", o.max_connections)
    check_int(f"{prefix}.max_in_flight", o.max_in_flight)
    check_int(f"{prefix}.max_queued_puts", o.max_queued_puts, 0)
    check_int(f"{prefix}.io_threads", o.io_threads)
    if o.max_in_flight > o.max_connections:
        raise ValueError(f"{prefix}.max_in_flight must be <= {prefix}.max_connections")
    _check_health(f"{prefix}.health", o.health)


class StoreConfig(msgspec.Struct, **_STRUCT):
    """The whole store. ``save_partial_chunks`` lets the keyer emit a key for
    a request's trailing partial chunk."""

    cpu: CPUConfig = msgspec.field(default_factory=CPUConfig)
    tiers: tuple[TierSpec, ...] = ()
    save_partial_chunks: bool = False
    close_timeout_s: float = 30.0

    def validate(self) -> None:
        self.cpu.validate("cpu")
        check_float("close_timeout_s", self.close_timeout_s)
        names: set[str] = set()
        for i, spec in enumerate(self.tiers):
            if not spec.type:
                raise ValueError(f"tiers[{i}].type must be a tier name or a dotted class path")
            name = spec.name or spec.type
            if name in names or name == "cpu":
                raise ValueError(f"tiers[{i}].name {name!r} is used twice (or is 'cpu')")
            names.add(name)
            if spec.read_bandwidth_bps is not None:
                check_float(f"tiers[{i}].read_bandwidth_bps", spec.read_bandwidth_bps)


def decode_options(options: Mapping[str, object], cls: type[_Options], prefix: str) -> _Options:
    """Options dict -> the tier's options Struct; errors name the field."""
    try:
        opts = msgspec.convert(options, cls)
    except msgspec.ValidationError as e:
        raise ValueError(f"{prefix}: {e}") from None
    opts.validate(prefix)
    return opts


def _check_health(prefix: str, h: HealthConfig) -> None:
    check_float(f"{prefix}.retry_interval_s", h.retry_interval_s)
    check_float(f"{prefix}.max_retry_interval_s", h.max_retry_interval_s)
