"""kvstrata.enginecore: the loop side of the engine. Requests
(``request.py``), the scheduler (``scheduler/``), the engine core and its
asyncio shell (``engine_core.py``, ``async_engine.py``), the ``EngineClient``
Protocol every transport implements (``client.py``), client-side input and
output processing (``processing.py``) and the composition root
(``builder.py``). The model runner it drives is ``kvstrata.worker``'s.

Exports are resolved lazily (PEP 562), so importing a light submodule such
as ``kvstrata.types`` does not import the KV manager or torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AsyncEngine": "kvstrata.enginecore.async_engine",
    "EngineCore": "kvstrata.enginecore.engine_core",
    "Scheduler": "kvstrata.enginecore.scheduler",
    "Request": "kvstrata.enginecore.request",
    "RequestStatus": "kvstrata.enginecore.request",
    "EngineRequest": "kvstrata.enginecore.request",
    "RequestError": "kvstrata.errors",
    "EngineOverloadedError": "kvstrata.errors",
    "EngineDeadError": "kvstrata.errors",
    "SamplingParams": "kvstrata.types",
    "SchedulerOutput": "kvstrata.types",
    "ModelRunnerOutput": "kvstrata.types",
    "RequestOutput": "kvstrata.types",
    "EngineStats": "kvstrata.types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:  # Any: a lazily imported export (PEP 562)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstrata.enginecore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
