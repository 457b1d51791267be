"""kvstrata: an asyncio engine core for LLM inference.

Subpackages:
  kvstrata.kv          device KV cache manager (paged blocks, prefix caching, events)
  kvstrata.kernels     Triton kernels with torch references, CUDA stream handling
  kvstrata.io          tiered KV store (CPU, disk, Redis) behind priority executors
  kvstrata.enginecore  requests, scheduler, model runner, async engine
"""

__version__ = "0.1.0"
