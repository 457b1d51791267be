"""The scheduler (``Scheduler``, in ``scheduler.py``) and its parts: waiting
queues per policy (``queues``), admission of waiting requests (``waiting``),
the running-request plan of one step (``plan``), the KV-transfer bookkeeping
(``transfers``), stop checks (``stop``), and counters (``stats``)."""

from kvstrata.enginecore.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
