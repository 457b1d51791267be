"""The scheduler (``Scheduler``, in ``scheduler.py``) and its parts, none of
which imports it: waiting queues per policy (``queues``), the admission of
one waiting request (``waiting.admit``), one step's plan and the output it
becomes (``plan``), the KV-transfer tracker that returns what a step's
transfers settle (``transfers``), the steps in flight (``steps``), a step's
sampled tokens applied and rejected drafts rolled back (``update``),
preemption victims (``preemption``), a split tier hit's next part
(``split_load``), stop checks (``stop``), and counters (``stats``). The Scheduler owns the state and applies their decisions."""

from kvstrata.enginecore.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
