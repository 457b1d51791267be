"""kvstrata.api_server: the OpenAI-compatible HTTP server (``kvstrata serve``)
over any EngineClient: routes (``server.py``), request and response schemas
(``openai_types.py``), Prometheus metrics (``metrics.py``)."""
