"""Load testing: workloads, targets (in-process, ZMQ, HTTP), the driver and
the report. ``tools/loadtest.py`` and ``kvstrata bench`` are its front ends."""
