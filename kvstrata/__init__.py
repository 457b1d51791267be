"""kvstrata: an asyncio engine core for LLM inference.

The package face: it imports nothing (layer 0), so importing any part of
kvstrata never loads the rest. Subpackages, lowest layer first (a layer
imports only from itself and lower ones; docs/ARCHITECTURE.md is the map):

  0  config, config_io, logs, types, errors   configuration, boundary Structs, errors
  1  kernels   Triton kernels with torch references, CUDA stream handling
     kv        device KV cache manager (paged blocks, prefix caching, events)
     io        tiered KV store (CPU, disk, Redis) behind priority executors
     text      tokenizers and the incremental detokenizer (client-side text work)
  2  connector KV connector API; the offload connector over the tiered store
  3  worker    the step thread's model stack: model runner, input batch, sampler, model
  4  enginecore requests, scheduler, EngineCore, AsyncEngine, EngineClient, builder
  5  ipc       the ZMQ engine subprocess, MPEngineClient, the KV events publisher
  6  api_server the OpenAI-compatible HTTP server
  7  bench     the load-test library
  8  cli       the ``kvstrata`` command
"""

__version__ = "0.1.0"
