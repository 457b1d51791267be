"""Token sampling over a batch of logits rows, vectorised.

Order, as in vLLM v1: raw log-probabilities (for ``logprobs``) are taken from
the model's logits before anything else; then stop tokens are banned for rows
still under ``min_tokens``; greedy rows take the argmax; random rows divide
by their temperature, drop tokens under ``min_p`` x the top probability, apply
top-k and top-p, and draw one token by inverse CDF (one uniform number per
row, searched in the fp64 cumulative distribution).

Seeded rows draw their uniform from their own ``torch.Generator``; the model runner
reseeds it from (request seed, position) every step, so a seeded request's
tokens do not depend on which other requests share its batch nor on whether it
was preempted and recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstrata.types import Logprobs

_MASK = float("-inf")


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row parameters for one step's sampled rows (built by the model runner).

    ``temperature`` [S] fp32, 0 for greedy rows. ``top_k`` [S] int64 (0 or >= V:
    disabled), ``top_p`` [S] fp32 and ``min_p`` [S] fp32 are None when no row
    uses them. ``generators`` maps a row to its seeded generator.
    ``num_logprobs[i]`` is None when row i asked for none.
    ``banned_token_ids`` maps a row to token ids it may not sample this step.
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    num_logprobs: list[int | None] | None = None
    banned_token_ids: dict[int, list[int]] = field(default_factory=dict)


class Sampler:
    """Owns: the generator used by unseeded random rows."""

    __slots__ = ("generator",)

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata
    ) -> tuple[list[int], list[Logprobs | None] | None]:
        """Sample one token per row of fp32 ``logits`` [S, V]; returns the token ids
        and, when any row asked for them, per-row ``Logprobs``."""
        raw_logprobs = None
        if meta.num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        sampled = self.sample(logits, meta)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, meta.num_logprobs)
        return sampled.tolist(), logprobs

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The sampled token ids [S] (int64), left on the logits' device: no
        host sync (logprobs are ``__call__``'s)."""
        if meta.banned_token_ids:
            logits = ban(logits, meta.banned_token_ids)
        return self._sample(logits, meta)

    def verify_drafts(self, logits: torch.Tensor, meta: SamplingMetadata,
                      groups: list[tuple[int, list[int] | None]]) -> list[list[int]]:
        """Sample, and verify draft tokens (speculative decoding). ``groups``:
        per request, its first row and its drafts (None: one row, sampled as
        usual); a request with d drafts has d + 1 rows, the model's
        distributions after its token and after each draft. Returns, per
        request, the drafts kept and then one token of the model's own.

        Greedy rows keep drafts while they equal the argmax. Random rows keep
        draft j with probability p_j(draft_j) (the proposer's drafts are
        deterministic: min(1, p/q) with q one-hot); the first rejected one is
        replaced by a draw from p_j without it (renormalised), and when all
        are kept the last row's draw is the bonus token: the tokens are
        distributed exactly as sampling one at a time from the model. Rows
        must not ask for logprobs, seeds or banned tokens (the proposer gives
        such requests no drafts)."""
        if meta.banned_token_ids:
            logits = ban(logits, meta.banned_token_ids)
        greedy = logits.argmax(dim=-1)
        probs = None if meta.all_greedy else self._probs(logits, meta)
        drawn_t = greedy if probs is None else self._draw(probs, meta.generators)
        if probs is not None and not meta.all_random:
            drawn_t = torch.where(meta.temperature == 0.0, greedy, drawn_t)
        # one read back for every row (a host sync each on a GPU)
        drawn, best, is_greedy = torch.stack([drawn_t, greedy, (meta.temperature == 0.0).long()]).tolist()
        out: list[list[int] | None] = []
        verify: list[tuple[int, int, list[int]]] = []  # (request, first row, drafts): random rows with drafts
        for first, drafts in groups:
            if not drafts:
                out.append([drawn[first]])
            elif is_greedy[first]:
                k, d = 0, len(drafts)
                while k < d and best[first + k] == drafts[k]:
                    k += 1
                out.append([*drafts[:k], best[first + k]])
            else:
                verify.append((len(out), first, drafts))
                out.append(None)
        if verify:
            assert probs is not None
            self._verify_random(probs, drawn, verify, out)
        return out  # type: ignore[return-value]  # every None was filled in

    def _verify_random(self, probs: torch.Tensor, drawn: list[int], verify: list[tuple[int, int, list[int]]],
                       out: list[list[int] | None]) -> None:
        """Random rows' drafts, all requests at once (two reads back in all):
        draft j kept with probability p_j(draft_j), the first rejected one
        replaced by a draw from p_j without it."""
        rows = [first + j for _, first, drafts in verify for j in range(len(drafts))]
        ids = [t for _, _, drafts in verify for t in drafts]
        dev = probs.device
        index = torch.tensor([rows, ids], dtype=torch.int64, pin_memory=probs.is_cuda).to(dev, non_blocking=True)
        u = torch.rand(len(rows), dtype=torch.float64, device=dev, generator=self.generator)
        us, targets = torch.stack([u, probs[index[0], index[1]].to(torch.float64)]).tolist()
        rejected: list[tuple[int, list[int], int, int]] = []  # (request, drafts, k, row of p_k)
        at = 0
        for i, first, drafts in verify:
            d, k = len(drafts), 0
            while k < d and us[at + k] < targets[at + k]:
                k += 1
            at += d
            if k == d:
                out[i] = [*drafts, drawn[first + d]]
            else:
                rejected.append((i, drafts, k, first + k))
        if not rejected:
            return
        pick = torch.tensor([[r for *_, r in rejected], [drafts[k] for _, drafts, k, _ in rejected]],
                            dtype=torch.int64, pin_memory=probs.is_cuda).to(dev, non_blocking=True)
        residual = probs.index_select(0, pick[0])
        residual[torch.arange(len(rejected), device=dev), pick[1]] = 0.0
        tokens, empty = torch.stack([self._draw(residual, {}), (residual.sum(dim=-1) <= 0.0).long()]).tolist()
        for (i, drafts, k, row), token, no_mass in zip(rejected, tokens, empty, strict=True):
            # all of p_k's mass on the draft (it cannot be rejected): defensive
            out[i] = [*drafts[:k], drawn[row] if no_mass else token]

    def _probs(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution each random row samples from (after temperature,
        min-p, top-k and top-p); greedy rows get temperature 1 (their draw is
        discarded)."""
        temperature = meta.temperature
        if not meta.all_random:
            temperature = torch.where(temperature == 0.0, 1.0, temperature)
        x = logits / temperature.unsqueeze(1)
        if meta.min_p is not None:
            x = apply_min_p(x, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            x = apply_top_k_top_p(x, meta.top_k, meta.top_p)
        return torch.softmax(x, dim=-1)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        drawn = self._draw(self._probs(logits, meta), meta.generators)
        if greedy is None:
            return drawn
        return torch.where(meta.temperature == 0.0, greedy, drawn)

    def _draw(self, probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """One token per row by inverse CDF: a single uniform per row, not one
        random number per vocabulary entry (the exponential race would draw
        S x V of them, ~10x slower on CPU for a 128k vocabulary)."""
        rows, vocab = probs.shape
        cdf = probs.to(torch.float64).cumsum_(dim=-1)
        u = torch.rand(rows, 1, dtype=torch.float64, device=probs.device, generator=self.generator)
        for row, gen in generators.items():
            u[row] = torch.rand(1, dtype=torch.float64, device=probs.device, generator=gen)
        drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(max=vocab - 1)
        # A zero-width (masked) token can only be hit through rounding at the
        # very top of the CDF; such a row falls back to its most likely token.
        valid = probs.gather(1, drawn.unsqueeze(1)).squeeze(1) > 0
        return torch.where(valid, drawn, probs.argmax(dim=-1))


def ban(logits: torch.Tensor, banned: dict[int, list[int]]) -> torch.Tensor:
    """A copy of ``logits`` with ``banned[row]``'s ids masked in each row.
    Ids past the vocabulary (a stop id or EOS the model cannot produce) are
    left out: out-of-range on a GPU is a device assert that ends the engine.
    The index goes to the device from pinned memory, non-blocking: a Python
    list as an index would be a pageable copy, a host sync in the step."""
    vocab = logits.shape[-1]
    pairs = [(row, t) for row, ids in banned.items() for t in ids if t < vocab]
    if not pairs:
        return logits
    index = torch.tensor(pairs, dtype=torch.int64, pin_memory=logits.is_cuda).to(logits.device, non_blocking=True)
    return logits.index_put((index[:, 0], index[:, 1]), logits.new_full((), _MASK))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` x the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, _MASK)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (ties with the k-th kept) and the
    smallest set of most likely tokens whose probability reaches ``top_p``.

    top_k <= 0 or >= V and top_p == 1 leave a row unchanged. The most likely
    token always survives.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, _MASK)
    if top_p is not None:
        cum = torch.softmax(sorted_logits, dim=-1).cumsum_(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, _MASK)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: list[int | None]
) -> list[Logprobs | None]:
    """The sampled token's log-probability first, then the row's top-n.

    ``sampled_rank`` is 0-based: the number of tokens strictly more likely
    than the sampled one (0 for a greedy pick).
    """
    max_n = max((n for n in num_logprobs if n is not None), default=0)
    chosen = raw_logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (raw_logprobs > chosen).sum(dim=-1).tolist()
    chosen_list = chosen.squeeze(1).tolist()
    sampled_list = sampled.tolist()
    top_vals: list[list[float]] = [[] for _ in num_logprobs]
    top_ids: list[list[int]] = [[] for _ in num_logprobs]
    if max_n > 0:
        vals, ids = raw_logprobs.topk(max_n, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    out: list[Logprobs | None] = []
    for i, n in enumerate(num_logprobs):
        if n is None:
            out.append(None)
            continue
        out.append(
            Logprobs(
                token_ids=[sampled_list[i], *top_ids[i][:n]],
                logprobs=[chosen_list[i], *top_vals[i][:n]],
                sampled_rank=ranks[i],
            )
        )
    return out
