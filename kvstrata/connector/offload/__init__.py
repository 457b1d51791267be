"""The offload connector: ``kvstrata.io``'s tiered store behind the KV connector API."""

from kvstrata.connector.offload.connector import OffloadConnector
from kvstrata.connector.offload.options import OffloadOptions
from kvstrata.connector.offload.scheduler import OffloadScheduler
from kvstrata.connector.offload.worker import OffloadWorker

__all__ = ["OffloadConnector", "OffloadOptions", "OffloadScheduler", "OffloadWorker"]
