"""kvstrata.connector: the KV connector API (scheduler and worker roles),
the factory of connectors by name or dotted path, the multi-connector, and
(in ``offload``, imported on demand) the connector over the tiered store.

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
