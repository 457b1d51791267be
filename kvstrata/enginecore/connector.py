"""The scheduler's view of a KV connector. The connector API (both roles,
the factory, the offload connector) lives in ``kvstrata.kv.connector``;
this module keeps the names the scheduler and its tests import.

``NoOpConnector`` here is the *scheduler side* of no connector (every call
answers "nothing to do"); subclass it to script a connector in tests.
"""

from __future__ import annotations

from kvstrata.kv.connector.base import KVConnectorScheduler, NoOpScheduler

NoOpConnector = NoOpScheduler

__all__ = ["KVConnectorScheduler", "NoOpConnector"]
