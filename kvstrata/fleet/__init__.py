"""Several engine replicas behind one ``EngineClient``, routed by the
KV-cache-aware router (``kvstrata.router``).

    replica  Replica: how to (re)connect to one engine (local subprocess or
             remote address) and its live connection
    client   FleetClient: routing, KV events into the router's index,
             failure handling (retry, restart, reconnect)
"""

from kvstrata.fleet.client import FleetClient
from kvstrata.fleet.replica import Replica, local_connector, remote_connector

__all__ = ["FleetClient", "Replica", "local_connector", "remote_connector"]
