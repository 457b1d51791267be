"""KVConnectorFactory: connector classes by name, imported only when used.

    factory = KVConnectorFactory()                 # the built-ins, nothing imported yet
    factory.register("mine", "my_pkg.kv:MyConnector")
    connector = await factory.open(KVTransferConfig(connector="offload", options={...}))
    connector = await factory.open(KVTransferConfig(connector="my_pkg.kv.MyConnector"))

A name maps to a "module:Class" path that is imported on first use (the
offload connector pulls in torch and the tiered store; a process that runs
without a connector never imports them). A connector that is not registered
is loaded by its dotted path ("pkg.mod.Class" or "pkg.mod:Class"). A
connector class provides ``async open(config, factory)`` and the
``KVConnector`` protocol (``kvstrata.connector.base``).
"""

from __future__ import annotations

import importlib

from kvstrata.connector.base import KVConnector
from kvstrata.connector.config import KVTransferConfig

BUILTIN_CONNECTORS: tuple[tuple[str, str], ...] = (
    ("noop", "kvstrata.connector.base:NoOpConnector"),
    ("offload", "kvstrata.connector.offload.connector:OffloadConnector"),
    ("multi", "kvstrata.connector.multi:MultiConnector"),
)
_MEMBERS = ("open", "flush", "scheduler_side", "worker_side", "aclose", "set_wakeup")


class KVConnectorFactory:
    """Owns: the map from connector name to its class path, and the classes
    already imported (one factory per engine; no module-level registry)."""

    __slots__ = ("_paths", "_classes")

    def __init__(self, *, builtins: bool = True) -> None:
        self._paths: dict[str, str] = {}
        self._classes: dict[str, type[KVConnector]] = {}
        if builtins:
            for name, path in BUILTIN_CONNECTORS:
                self.register(name, path)

    def names(self) -> list[str]:
        return sorted(self._paths)

    def register(self, name: str, target: str | type) -> None:
        """Register ``name`` -> a "module:Class" path (imported lazily) or a class."""
        if not isinstance(name, str) or not name or "." in name or ":" in name:
            raise ValueError(f"connector name must be non-empty without '.' or ':', got {name!r}")
        if isinstance(target, type):
            self._classes[name] = _check_class(target, name)
            self._paths[name] = f"{target.__module__}:{target.__qualname__}"
        elif isinstance(target, str) and (":" in target or "." in target):
            self._paths[name] = target
            self._classes.pop(name, None)
        else:
            raise TypeError(f"connector {name!r}: target must be a class or a 'module:Class' path, got {target!r}")

    def is_loaded(self, name: str) -> bool:
        """True once ``name``'s class has been imported (lazy loading is observable)."""
        return name in self._classes

    def resolve(self, connector: str, prefix: str = "kv_transfer") -> type[KVConnector]:
        """The class for a registered name or a dotted path."""
        cls = self._classes.get(connector)
        if cls is not None:
            return cls
        path = self._paths.get(connector)
        if path is None:
            if "." not in connector and ":" not in connector:
                raise ValueError(
                    f"{prefix}.connector {connector!r} is not one of {self.names()} nor a dotted class path"
                )
            path = connector
        cls = _check_class(_import(path, prefix), connector)
        self._classes[connector] = cls
        return cls

    async def open(self, config: KVTransferConfig, prefix: str = "kv_transfer") -> KVConnector:
        """Validate ``config``, import its class, open it on the running loop."""
        if not isinstance(config, KVTransferConfig):
            raise TypeError(f"{prefix} must be a KVTransferConfig, got {type(config).__name__}")
        config.validate(prefix)
        return await self.resolve(config.connector, prefix).open(config, self)


def _import(path: str, prefix: str) -> object:
    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not attr:
        raise ValueError(f"{prefix}.connector: {path!r} is not a 'module:Class' or 'module.Class' path")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{prefix}.connector: cannot load {path!r}: {e}") from None


def _check_class(cls: object, name: str) -> type[KVConnector]:
    if not isinstance(cls, type):
        raise TypeError(f"connector {name!r} does not name a class (got {type(cls).__name__})")
    missing = [m for m in _MEMBERS if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(f"connector {name!r} ({cls.__qualname__}) does not implement KVConnector; missing {missing}")
    return cls  # type: ignore[return-value]  # checked member by member above
