"""kvstrata.connector (layer 2, between ``enginecore`` and ``kv``/``io``/
``kernels``): the KV connector API as typed Protocols for its scheduler and
worker sides, with one no-op implementation (``base.py``); the engine's
wake-up as a connector holds it (``wakeup.py``); the factory of connectors
by name or dotted path; the multi-connector; and (in ``offload``, imported
on demand) the connector over the tiered store, which reaches the store
only through its ``StorageManager``.

Importing this package is light: no torch, no store; the factory imports a
connector's module only when a config names it.
"""

from kvstrata.connector.base import (
    BlockTables,
    ConnectorRequest,
    ConnectorSpec,
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
    NoOpConnector,
    NoOpConnectorScheduler,
    NoOpConnectorWorker,
)
from kvstrata.connector.config import KVTransferConfig
from kvstrata.connector.factory import KVConnectorFactory
from kvstrata.connector.metadata import (
    ChunkTransfer,
    MultiMetadata,
    MultiReport,
    OffloadMetadata,
    RequestTransfer,
    WorkerReport,
)

from kvstrata.connector.wakeup import Wakeup

__all__ = [
    "BlockTables", "ChunkTransfer", "ConnectorRequest", "ConnectorSpec", "KVConnector", "KVConnectorFactory",
    "KVConnectorScheduler", "KVConnectorWorker", "KVTransferConfig", "MultiMetadata", "MultiReport",
    "NoOpConnector", "NoOpConnectorScheduler", "NoOpConnectorWorker", "OffloadMetadata", "RequestTransfer",
    "Wakeup", "WorkerReport",
]
