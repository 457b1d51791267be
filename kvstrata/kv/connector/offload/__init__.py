"""The offload connector: ``kvstrata.io``'s tiered store behind the KV connector API."""

from kvstrata.kv.connector.offload.connector import OffloadConnector
from kvstrata.kv.connector.offload.options import OffloadOptions
from kvstrata.kv.connector.offload.scheduler import OffloadScheduler
from kvstrata.kv.connector.offload.worker import OffloadWorker

__all__ = ["OffloadConnector", "OffloadOptions", "OffloadScheduler", "OffloadWorker"]
