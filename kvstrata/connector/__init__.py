"""kvstrata.connector: the KV connector API (scheduler and worker roles),
the factory of connectors by name or dotted path, the multi-connector, and
(in ``offload``, imported on demand) the connector over the tiered store.

Importing this package is light: no torch, no store; the factory imports a
connector's module only when a config names it.
"""

from kvstrata.connector.base import (
    ConnectorSpec,
    KVConnector,
    KVConnectorRole,
    KVConnectorScheduler,
    KVConnectorWorker,
    NoOpConnector,
    NoOpScheduler,
    NoOpWorker,
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

__all__ = [
    "ChunkTransfer", "ConnectorSpec", "KVConnector", "KVConnectorFactory", "KVConnectorRole",
    "KVConnectorScheduler", "KVConnectorWorker", "KVTransferConfig", "MultiMetadata", "MultiReport",
    "NoOpConnector", "NoOpScheduler", "NoOpWorker", "OffloadMetadata", "RequestTransfer", "WorkerReport",
]
