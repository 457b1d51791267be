"""A prompt's block hash chain, computed exactly as the engine computes it,
once per prompt prefix and only as far as the decision needs.

The router hashes with the engine's own :class:`kvstrata.kv.hashing.BlockHasher`
over the engine's :class:`CacheIdentity` (model fingerprint, KV dtype and
layout, block size, algorithm, namespace), so the hashes it looks up are the
hashes in the engines' ``BlockStored`` events. An engine with
``cache.random_hash_root`` hashes from a private root: no router can match it.

Two savings, both exact (the chain is the one a full pass gives):

    incremental   an LRU of recent prompts (packed tokens, chain), keyed by
                  session (the OpenAI ``user`` field) and by first block: a
                  follow-up turn reuses the chain of the longest block-aligned
                  prefix it shares with the prompt found there and hashes
                  only its new tail
    lazy          a :class:`PromptChain` hashes block by block on demand:
                  ``Router.choose`` asks for blocks only while some live
                  replica still holds the prefix (a cold prompt: one block);
                  :meth:`PromptChain.finish` completes it after the decision

Packed tokens: the prompt's msgpack encoding (msgspec packs an 8k-token
list about twice as fast as ``array('I', ...)``). msgpack codes each integer
prefix-free, so two prompts whose encodings agree up to the byte where a
block of one ends agree on every token up to there: the LRU compares bytes
(memcmp), never token lists, and keeps, per entry, the byte offset where
each block ends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import accumulate

import msgspec

from kvstrata.kv.hashing import BlockHasher, CacheIdentity
from kvstrata.kv.types import BlockHash


class _Prompt:
    """The KVRequest fields the block hasher reads, for a prompt not yet sent."""

    __slots__ = ("request_id", "all_token_ids", "num_prompt_tokens", "block_hashes", "lora_name",
                 "cache_salt", "mm_features", "prompt_embeds_digest")

    def __init__(self, token_ids: Sequence[int], lora_name: str | None, cache_salt: str | None,
                 block_hashes: list[BlockHash] | None = None) -> None:
        self.request_id = "router"
        self.all_token_ids = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.block_hashes: list[BlockHash] = [] if block_hashes is None else block_hashes
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.mm_features: list = []
        self.prompt_embeds_digest = None


class _Entry:
    """One remembered prompt: its packed tokens (msgpack, no array header),
    the byte offset in ``body`` where each full block ends, its chain."""

    __slots__ = ("body", "ends", "hashes", "lora_name", "cache_salt")

    def __init__(self, body: bytes, ends: list[int], hashes: tuple[BlockHash, ...], lora_name: str | None,
                 cache_salt: str | None) -> None:
        self.body, self.ends, self.hashes = body, ends, hashes
        self.lora_name, self.cache_salt = lora_name, cache_salt


def _header_len(n: int) -> int:
    """The length of msgpack's array header for ``n`` items."""
    return 1 if n < 16 else 3 if n < 65536 else 5


class PromptChain:
    """One prompt's chain, hashed on demand. ``known``: the hashes computed
    (or reused) so far, a prefix of the chain; ``num_blocks``: the full
    blocks of the prompt. Single use, on one thread:

        chain = hasher.chain(tokens, session=user)
        chain.start()          # LRU lookup: the reused prefix (plus block 0)
        chain.extend_one()     # one more block's hash, None when complete
        chain.finish()         # the whole chain (remembered in the LRU)
    """

    __slots__ = ("num_tokens", "num_blocks", "known", "_owner", "_tokens", "_lora", "_salt", "_session",
                 "_enc", "_reused", "_ends", "_started", "_finished")

    def __init__(self, owner: PromptHasher, token_ids: Sequence[int], lora_name: str | None,
                 cache_salt: str | None, session: str | None) -> None:
        self.num_tokens = len(token_ids)
        self.num_blocks = len(token_ids) // owner.block_size
        self.known: list[BlockHash] = []
        self._owner = owner
        self._tokens = token_ids
        self._lora, self._salt, self._session = lora_name, cache_salt, session
        self._enc = b""
        self._reused = 0  # leading blocks taken from a remembered prompt
        self._ends: list[int] = []  # their byte ends, reused when this prompt is remembered
        self._started = self._finished = False

    def __len__(self) -> int:
        return self.num_blocks

    @property
    def reused_blocks(self) -> int:
        """How many leading blocks came from a remembered prompt (not hashed)."""
        return self._reused

    def start(self) -> list[BlockHash]:
        """Look the prompt up in the LRU (once): ``known`` becomes the longest
        remembered prefix, or block 0 alone. Returns ``known``."""
        if not self._started:
            self._started = True
            if self.num_blocks:
                self._owner._lookup(self)
        return self.known

    def extend_one(self) -> BlockHash | None:
        """Hash the next block; None when the chain is complete."""
        if not self._started:
            self.start()
        known, i = self.known, len(self.known)
        if i >= self.num_blocks:
            return None
        owner = self._owner
        if self._lora is None and self._salt is None:
            bs = owner.block_size
            parent = known[-1] if i else owner.root
            h = owner.hash_fn.hash_block(parent, self._tokens[i * bs: (i + 1) * bs])
            known.append(h)
            return h
        self._hash_rest()  # extra keys per block: hashed in one pass, handed out one by one
        return known[i]

    def finish(self) -> list[BlockHash]:
        """The whole chain (the same list as ``known``: do not change it);
        remembered in the LRU under the session and the first block."""
        if not self._finished:
            self.start()
            self._hash_rest()
            self._finished = True
            if self.num_blocks:
                self._owner._remember(self)
        return self.known

    def _hash_rest(self) -> None:
        known = self.known
        if len(known) < self.num_blocks:
            p = _Prompt(self._tokens, self._lora, self._salt, known)
            known.extend(self._owner._hasher(p))


class PromptHasher:
    """``chain(token_ids)`` / ``hash_prompt(token_ids)``: the hashes of the
    prompt's full blocks, lazily / at once.

    Owns: the LRU of recent prompts (``max_prompts`` keys: a session or a
    first block -> its entry); everything else is fixed at construction.
    Single-threaded (the server's event loop)."""

    __slots__ = ("identity", "block_size", "hash_fn", "root", "max_prompts", "counters", "_hasher", "_encode",
                 "_lru")

    def __init__(self, identity: CacheIdentity, *, max_prompts: int = 512) -> None:
        if not isinstance(max_prompts, int) or max_prompts < 0:
            raise ValueError(f"max_prompts must be an integer >= 0, got {max_prompts!r}")
        self.identity = identity
        self.block_size = identity.block_size
        self._hasher = BlockHasher(identity)
        self.hash_fn = self._hasher.hash_fn
        self.root = self._hasher.root
        self.max_prompts = max_prompts
        self._encode = msgspec.msgpack.Encoder().encode
        self._lru: OrderedDict[tuple[str, object], _Entry] = OrderedDict()
        self.counters = {"lookups": 0, "reused_blocks": 0, "hashed_blocks": 0}

    def chain(self, token_ids: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None,
              session: str | None = None) -> PromptChain:
        """The prompt's chain, nothing hashed yet (see :class:`PromptChain`)."""
        return PromptChain(self, token_ids, lora_name, cache_salt, session)

    def hash_prompt(self, token_ids: Sequence[int], *, lora_name: str | None = None,
                    cache_salt: str | None = None, session: str | None = None) -> list[BlockHash]:
        """The prompt's whole chain (reusing a remembered prefix)."""
        return self.chain(token_ids, lora_name=lora_name, cache_salt=cache_salt, session=session).finish()

    def __len__(self) -> int:
        return len(self._lru)

    # -- the LRU ----------------------------------------------------------------

    def _lookup(self, chain: PromptChain) -> None:
        self.counters["lookups"] += 1
        if not self.max_prompts:
            chain.extend_one()
            return
        tokens = chain._tokens
        enc = self._encode(tokens if isinstance(tokens, list) else list(tokens))
        chain._enc = enc
        hdr = _header_len(len(tokens))
        best_j, best = 0, None
        lru = self._lru
        if chain._session is not None:
            e = lru.get(("s", chain._session))
            if e is not None and e.lora_name == chain._lora and e.cache_salt == chain._salt:
                best_j, best = _match(e, enc, hdr, chain.num_blocks), e
        if best_j < chain.num_blocks:
            h0 = best.hashes[0] if best_j else None
            if h0 is None:  # block 0 names the first-block entry (lora and salt included)
                if chain._lora is None and chain._salt is None:
                    h0 = chain.extend_one()
                else:
                    h0 = self._hasher(_Prompt(tokens[: self.block_size], chain._lora, chain._salt))[0]
                    chain.known.append(h0)
            e = lru.get(("b", h0))
            if e is not None and e is not best:
                j = _match(e, enc, hdr, chain.num_blocks)
                if j > best_j:
                    best_j, best = j, e
        if best is None or best_j == 0:
            return
        if best_j > len(chain.known):
            chain.known[:] = best.hashes[:best_j]
        chain._reused = best_j
        chain._ends = best.ends[:best_j]
        self.counters["reused_blocks"] += best_j

    def _remember(self, chain: PromptChain) -> None:
        self.counters["hashed_blocks"] += chain.num_blocks - chain._reused
        if not self.max_prompts:
            return
        tokens, bs, n = chain._tokens, self.block_size, chain.num_blocks
        enc = chain._enc or self._encode(tokens if isinstance(tokens, list) else list(tokens))
        body = enc[_header_len(len(tokens)):]
        ends = chain._ends
        start = len(ends)
        if start < n:  # the byte ends of the blocks not reused: each block packed alone, header cut
            base = ends[-1] if ends else 0
            hb = _header_len(bs)
            encode = self._encode
            more = accumulate((len(encode(tokens[i * bs: (i + 1) * bs])) - hb for i in range(start, n)),
                              initial=base)
            next(more)
            ends = ends + list(more)
        entry = _Entry(body, ends, tuple(chain.known), chain._lora, chain._salt)
        lru = self._lru
        keys = [("b", chain.known[0])]
        if chain._session is not None:
            keys.append(("s", chain._session))
        for key in keys:
            lru[key] = entry
            lru.move_to_end(key)
        while len(lru) > self.max_prompts:
            lru.popitem(last=False)


def _match(e: _Entry, enc: bytes, hdr: int, num_blocks: int) -> int:
    """The most leading full blocks ``enc`` (a whole msgpack array, its
    header ``hdr`` bytes long) shares with entry ``e``, up to ``num_blocks``."""
    ends, body = e.ends, memoryview(e.body)
    hi = min(len(ends), num_blocks)
    if hi and enc.startswith(body[: ends[hi - 1]], hdr):
        return hi  # the usual follow-up turn: the whole remembered prompt is a prefix
    lo = 0  # invariant: lo blocks match, hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if enc.startswith(body[: ends[mid - 1]], hdr):
            lo = mid
        else:
            hi = mid
    return lo
