"""Configuration of the KV connector: which connector, in which role, with
its own options. Light on purpose (msgspec only): ``kvstrata.config`` embeds
``KVTransferConfig`` and must import without torch.

    KVTransferConfig(connector="offload", options={"store": {...}, "chunk_size": 256})
    KVTransferConfig(connector="multi", options={"connectors": [{...}, {...}]})
    KVTransferConfig(connector="my_pkg.connectors:MyConnector")   # dotted path

``role`` restricts what the engine does with the external store: "both"
saves and loads; "producer" (a prefill-only engine of a disaggregated pair)
saves and never loads; "consumer" (the decode engine) loads and never saves.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

ROLES = ("both", "producer", "consumer")


class KVTransferConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which connector the engine runs. ``connector`` is a registered name
    ("offload", "multi", "noop") or a dotted path to a connector class."""

    connector: str = "offload"
    role: Literal["both", "producer", "consumer"] = "both"
    options: dict[str, Any] = msgspec.field(default_factory=dict)

    def validate(self, prefix: str = "kv_transfer") -> None:
        if not isinstance(self.connector, str) or not self.connector:
            raise ValueError(f"{prefix}.connector must be a connector name or a dotted class path")
        if self.role not in ROLES:
            raise ValueError(f"{prefix}.role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.options, dict):
            raise ValueError(f"{prefix}.options must be a table of options")


def decode_options(options: dict[str, Any], cls: type, prefix: str) -> Any:
    """A connector's options table -> its options Struct; errors name the field."""
    try:
        opts = msgspec.convert(options, cls)
    except msgspec.ValidationError as e:
        raise ValueError(f"{prefix}: {e}") from None
    opts.validate(prefix)
    return opts
