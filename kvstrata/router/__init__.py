"""The KV-cache-aware router's core: an index of which replica holds which
block (fed by the engines' KV events), scoring and policies. Pure: no
sockets, no processes, no I/O; the server wires it to the engines.

    index    PrefixIndex: hash -> replicas per medium, epochs, sequence gaps
    load     ReplicaLoad and the rule that skips hot replicas
    hashes   PromptHasher: a prompt's hash chain, as the engine computes it
    shared   SharedPrefixes: prefixes many prompts continue, held everywhere for kv
    policy   Router, RouterConfig, Decision: kv / least-loaded / session / round-robin
"""

from kvstrata.router.hashes import PromptHasher
from kvstrata.router.index import CPU, DISK, GPU, MEDIA, REMOTE, IngestResult, PrefixIndex
from kvstrata.router.load import ReplicaLoad
from kvstrata.router.policy import POLICIES, Decision, NoLiveReplicaError, Router, RouterConfig

__all__ = [
    "CPU", "DISK", "GPU", "MEDIA", "POLICIES", "REMOTE", "Decision", "IngestResult", "NoLiveReplicaError",
    "PrefixIndex", "PromptHasher", "ReplicaLoad", "Router", "RouterConfig",
]
