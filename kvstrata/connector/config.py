"""Configuration of the KV connector: which connector, in which role, with
its own options. ``KVTransferConfig`` itself lives in ``kvstrata.config``
(``EngineConfig.kv_transfer``; that module stays light) and is re-exported here.

    KVTransferConfig(connector="offload", options={"store": {...}, "chunk_size": 256})
    KVTransferConfig(connector="multi", options={"connectors": [{...}, {...}]})
    KVTransferConfig(connector="my_pkg.connectors:MyConnector")   # dotted path

``role`` restricts what the engine does with the external store: "both"
saves and loads; "producer" (a prefill-only engine of a disaggregated pair)
saves and never loads; "consumer" (the decode engine) loads and never saves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, TypeVar

import msgspec

from kvstrata.config import KVTransferConfig

__all__ = ["ROLES", "KVTransferConfig", "decode_options"]

ROLES = ("both", "producer", "consumer")


class _Validating(Protocol):
    def validate(self, prefix: str) -> None: ...


_Options = TypeVar("_Options", bound=_Validating)


def decode_options(options: Mapping[str, object], cls: type[_Options], prefix: str) -> _Options:
    """A connector's options table -> its options Struct; errors name the field."""
    try:
        opts = msgspec.convert(options, cls)
    except msgspec.ValidationError as e:
        raise ValueError(f"{prefix}: {e}") from None
    opts.validate(prefix)
    return opts
