"""Pieces of the scheduler (``kvstrata.enginecore.scheduler``): waiting
queues per policy (``queues``), admission of waiting requests (``waiting``),
the running-request plan of one step (``plan``), stop checks and incremental
text (``stop``), and counters (``stats``)."""
