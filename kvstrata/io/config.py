"""Configuration of the tiered store: one small Struct per component.

``StoreConfig`` holds the L1 (CPU) section and an ordered list of lower tiers
(fastest first). A lower tier is a ``TierSpec``: a type (a registry name such
as ``"disk"``, or a dotted path to a class for user tiers), its write mode and
its own options, which the tier class decodes into its options Struct.
Bad values raise ValueError naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from kvstrata.io.policies import POLICIES

_STRUCT = dict(frozen=True, kw_only=True, forbid_unknown_fields=True)


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
    options: dict[str, Any] = msgspec.field(default_factory=dict)


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


class RedisOptions(msgspec.Struct, **_STRUCT):
    """A Redis server through redis.asyncio. Keys are
    ``{key_prefix}:{identity}:{name}:{m|d}`` (metadata, data)."""

    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_check_hostname: bool = True
    # The server's certificate is verified (against ssl_ca_certs, else the
    # system's CA store) unless this is set: for test setups only.
    ssl_insecure_skip_verify: bool = False
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
        if self.ttl_s is not None:
            check_int(f"{prefix}.ttl_s", self.ttl_s)
        if not self.key_prefix or ":" in self.key_prefix:
            raise ValueError(f"{prefix}.key_prefix must be non-empty and contain no ':'")
        if self.ssl_insecure_skip_verify and self.ssl_ca_certs:
            raise ValueError(f"{prefix}.ssl_insecure_skip_verify contradicts {prefix}.ssl_ca_certs: "
                             "a CA is given to verify against")
        check_float(f"{prefix}.socket_timeout_s", self.socket_timeout_s)
        check_float(f"{prefix}.connect_timeout_s", self.connect_timeout_s)
        check_int(f"{prefix}.max_connections", self.max_connections)
        check_int(f"{prefix}.max_in_flight", self.max_in_flight)
        check_int(f"{prefix}.max_queued_puts", self.max_queued_puts, 0)
        check_int(f"{prefix}.io_threads", self.io_threads)
        if self.max_in_flight > self.max_connections:
            raise ValueError(f"{prefix}.max_in_flight must be <= {prefix}.max_connections")
        _check_health(f"{prefix}.health", self.health)


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


def decode_options(options: dict[str, Any], cls: type[msgspec.Struct], prefix: str) -> Any:
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
