"""CacheBlend quality and time to first token on SmolLM2-135M-Instruct
(the GGUF the CLI uses), against a full prefill in the same run. Prints JSON.

    python tools/bench_blend.py [--requests 16] [--ratios 0 0.05 0.15 0.3 1] [--new-tokens 16]
                                [--select-layer 1] [--deviation key|value] [--threads 2]
                                [--seed 0] [--model PATH]

A RAG-style set built in code: short passages of invented facts and
questions each answered by exactly one passage. Each request picks 4-6
passages including the answer's, in a shuffled order, and asks one question
in the model's chat format::

    [ system + "Passages:" | passage | passage | ... | question + assistant turn ]
      cached, position 0     cached (standalone KV, re-rotated)   always computed

Every passage's KV (and the shared system prefix's) is computed once on its
own and reused by every request (``kvstrata.worker.blend``). Per recompute
ratio, against the full prefill of the same tokens:

* ``first_token_agreement``: argmax of the first-token logits equal;
* ``mean_kl``: mean KL(full || blended) of the first-token distribution (nats);
* ``greedy_exact``: the ``--new-tokens`` greedy tokens all equal (the first
  from the prefill's logits, the rest decoded with the blended KV as cache);
* ``greedy_prefix``: mean length of the common greedy prefix / the longer
  of the two (an EOS may end either before ``--new-tokens``);
* ``answer_hit``: the answer's key word appears in the decoded text
  (the full prefill's own rate is the ceiling);
* ``ttft_ms_median``: median wall time of the prefill up to the first-token
  logits, segment KV already cached; ``speedup_vs_full`` divides the full
  prefill's median by it. The full prefill runs through the same per-layer
  code (ratio 1 does the same work); ``model_forward_ttft_ms_median`` is the
  engine's paged forward on the same prompts, for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstrata.text.tokenizer import load_tokenizer
from kvstrata.worker.blend import (
    BlendResult,
    SegmentKV,
    blend_prefill,
    compute_segment_kv,
    full_prefill,
    greedy_decode,
)
from kvstrata.worker.model import AttentionMetadata, LlamaForCausalLM, load_checkpoint
from kvstrata.worker.model.smollm2 import locate_smollm2

SYSTEM = "You are a helpful assistant. Answer the question using only the passages."
PASSAGES = [
    "The capital of Veloria is Marnek. Marnek lies on the banks of the river Ost.",
    "The Drellan fox has silver fur and lives only on the island of Kespa.",
    "The inventor of the skyglass lens was Tamsin Orrow, who built it in the town of Hallowick.",
    "Lake Quorra is the deepest lake in Veloria, at 912 meters.",
    "The national dish of Pellaria is brindle stew, made with barley and smoked eel.",
    "The Zentar mountains are the highest range on Kespa. Their tallest peak is Mount Ilvar.",
    "The currency of Pellaria is the crown. One crown is worth ten pennets.",
    "The poet Amara Velt wrote the epic poem The Glass Tide. She was born in Marnek.",
    "The Orrow Bridge connects Hallowick to Dunmere and was finished in the year 1742.",
    "In Kespa, the spring festival is called Lumenday and is celebrated with paper lanterns.",
]
# (question, index of the passage that answers it, key words of the answer: any one counts)
QUESTIONS = [
    ("What is the capital of Veloria?", 0, "Marnek"),
    ("Which river flows through Marnek?", 0, "Ost"),
    ("Where does the Drellan fox live?", 1, "Kespa"),
    ("What color is the fur of the Drellan fox?", 1, "silver"),
    ("Who invented the skyglass lens?", 2, "Orrow"),
    ("How deep is Lake Quorra?", 3, "912"),
    ("What is the national dish of Pellaria?", 4, "brindle"),
    ("What is the tallest peak of the Zentar mountains?", 5, "Ilvar"),
    ("What is the currency of Pellaria?", 6, "crown"),
    ("How many pennets is one crown worth?", 6, "ten|10"),
    ("Who wrote The Glass Tide?", 7, "Velt"),
    ("Where was Amara Velt born?", 7, "Marnek"),
    ("In which year was the Orrow Bridge finished?", 8, "1742"),
    ("Which towns does the Orrow Bridge connect?", 8, "Dunmere"),
    ("What is the spring festival in Kespa called?", 9, "Lumenday"),
    ("What is used to celebrate Lumenday?", 9, "lantern"),
]
MARKER = "\x00PASSAGES\x00"


class Prompt:
    """One request's token ids, its cached spans (prefix, passages) and their keys."""

    __slots__ = ("token_ids", "segments", "keys", "answer")

    def __init__(self, token_ids: list[int], segments: list[tuple[int, int]], keys: list[int], answer: str) -> None:
        self.token_ids, self.segments, self.keys, self.answer = token_ids, segments, keys, answer


def build_prompts(tok: Any, n: int, seed: int) -> tuple[list[Prompt], dict[int, list[int]]]:
    """``n`` requests and the token ids of every cacheable piece (key -1: the
    system prefix, key i: passage i). Pieces are tokenized on their own, so
    a passage has the same ids in every request."""
    rng = random.Random(seed)
    pieces: dict[int, list[int]] = {i: tok.encode(p + "\n", add_special_tokens=False) for i, p in enumerate(PASSAGES)}
    prompts = []
    for r in range(n):
        question, answer_idx, key_word = QUESTIONS[r % len(QUESTIONS)]
        others = rng.sample([i for i in range(len(PASSAGES)) if i != answer_idx], rng.randint(3, 5))
        chosen = [answer_idx, *others]
        rng.shuffle(chosen)
        rendered = tok.chat_template.render([{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": MARKER + f"Question: {question}"}])
        head, tail = rendered.split(MARKER)
        pieces[-1] = tok.encode(head + "Passages:\n", add_special_tokens=False)
        ids, segments, keys = [], [], []
        for key in [-1, *chosen]:
            segments.append((len(ids), len(ids) + len(pieces[key])))
            keys.append(key)
            ids += pieces[key]
        ids += tok.encode(tail, add_special_tokens=False)
        prompts.append(Prompt(ids, segments, keys, key_word))
    return prompts, pieces


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - start) * 1e3


def model_forward_prefill(model: LlamaForCausalLM, ids: Sequence[int], block_size: int = 16) -> torch.Tensor:
    """The engine's paged forward over the prompt into a fresh cache; last-token logits."""
    cfg, n = model.config, len(ids)
    blocks = 1 + -(-n // block_size)
    caches = [tuple(torch.empty(blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype=model.dtype)
                    for _ in range(2)) for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(block_size, block_size + n),
                             block_tables=torch.arange(1, blocks, dtype=torch.int32)[None, :],
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32))
    hidden = model(torch.tensor(ids), torch.arange(n), meta, caches)
    return model.compute_logits(hidden[-1:])[0]


def kl(full_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(full || other) in nats."""
    p = torch.log_softmax(full_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(args: argparse.Namespace) -> dict:
    load_at_start = round(os.getloadavg()[0], 2)  # other processes on the cores skew every time below
    torch.set_num_threads(args.threads)
    path = args.model or str(locate_smollm2(download=True))
    ckpt = load_checkpoint(path)
    model = ckpt.model
    tok = load_tokenizer(path, gguf_metadata=ckpt.gguf_metadata)
    stops = tuple(tok.eos_token_ids)
    prompts, pieces = build_prompts(tok, args.requests, args.seed)
    seg_cache: dict[int, SegmentKV]
    seg_cache, seg_ms = timed(lambda: {key: compute_segment_kv(model, ids) for key, ids in pieces.items()})

    def blend(p: Prompt, ratio: float) -> BlendResult:
        return blend_prefill(model, p.token_ids, p.segments, [seg_cache[k] for k in p.keys], ratio,
                             select_layer=args.select_layer, deviation=args.deviation)

    blend(prompts[0], args.ratios[0])  # warm-up: first-call allocations stay out of the timings
    full_prefill(model, prompts[0].token_ids)
    rows: dict[str, dict[str, list]] = {name: {} for name in ["full", *map(str, args.ratios)]}
    forward_ms = []
    for p in prompts:
        full, ms = timed(lambda p=p: full_prefill(model, p.token_ids))
        full_tokens = greedy_decode(model, full, args.new_tokens, stop_ids=stops)
        _add(rows["full"], ttft_ms=ms, hit=_hit(tok, full_tokens, p.answer))
        forward_ms.append(timed(lambda p=p: model_forward_prefill(model, p.token_ids))[1])
        for ratio in args.ratios:
            res, ms = timed(lambda p=p, ratio=ratio: blend(p, ratio))
            tokens = greedy_decode(model, res, args.new_tokens, stop_ids=stops)
            _add(rows[str(ratio)], ttft_ms=ms, kl=kl(full.logits, res.logits),
                 first=float(tokens[0] == full_tokens[0]), exact=float(tokens == full_tokens),
                 prefix=common_prefix(tokens, full_tokens) / max(len(tokens), len(full_tokens)),
                 hit=_hit(tok, tokens, p.answer),
                 recomputed=len(res.recomputed))
    full_ttft = statistics.median(rows["full"]["ttft_ms"])
    table = [_summary("full", rows["full"], full_ttft)]
    table += [_summary(ratio, rows[str(ratio)], full_ttft) for ratio in args.ratios]
    lengths = [len(p.token_ids) for p in prompts]
    cached = [sum(e - s for s, e in p.segments) / len(p.token_ids) for p in prompts]
    return {
        "bench": "blend",
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]) if args.command is None else args.command,
        "platform": {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
                     "processor": platform.processor(), "system": platform.system(), "cpus": os.cpu_count(),
                     "load_avg_1m_at_start": load_at_start},
        "torch_threads": torch.get_num_threads(),
        "model": path,
        "dtype": ckpt.dtype,
        "requests": len(prompts),
        "new_tokens": args.new_tokens,
        "select_layer": args.select_layer,
        "deviation": args.deviation,
        "prompt_tokens_median": statistics.median(lengths),
        "cached_fraction_mean": round(statistics.mean(cached), 4),
        "segment_kv_compute_ms_total": round(seg_ms, 1),
        "model_forward_ttft_ms_median": round(statistics.median(forward_ms), 2),
        "rows": table,
    }


def _add(acc: dict[str, list], **values: float) -> None:
    for name, value in values.items():
        acc.setdefault(name, []).append(value)


def _hit(tok: Any, tokens: list[int], answer: str) -> float:
    text = tok.decode(tokens).lower()
    return float(any(word.lower() in text for word in answer.split("|")))


def _summary(ratio: float | str, acc: dict[str, list], full_ttft: float) -> dict:
    ttft = statistics.median(acc["ttft_ms"])
    row: dict[str, Any] = {"ratio": ratio}
    if "kl" in acc:
        row |= {"first_token_agreement": statistics.mean(acc["first"]), "mean_kl": statistics.mean(acc["kl"]),
                "greedy_exact": statistics.mean(acc["exact"]), "greedy_prefix": statistics.mean(acc["prefix"]),
                "recomputed_tokens_median": statistics.median(acc["recomputed"])}
    row |= {"answer_hit": statistics.mean(acc["hit"]), "ttft_ms_median": round(ttft, 2),
            "speedup_vs_full": round(full_ttft / ttft, 3)}
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16, help="number of RAG requests (default 16)")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.05, 0.15, 0.3, 1.0],
                    help="recompute ratios to measure (default 0 0.05 0.15 0.3 1)")
    ap.add_argument("--new-tokens", type=int, default=16, help="greedy tokens compared per request (default 16)")
    ap.add_argument("--select-layer", type=int, default=1,
                    help="layer at which the recomputed tokens are picked (default 1)")
    ap.add_argument("--deviation", choices=["key", "value"], default="key",
                    help="what picks them: the K or the V furthest from the cached one (default key)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the passage choice and order (default 0)")
    ap.add_argument("--model", default=None,
                    help="GGUF path (default: the SmolLM2-135M-Instruct GGUF, found or fetched once)")
    args = ap.parse_args(argv)
    args.command = None if argv is None else " ".join(["python tools/bench_blend.py", *argv])
    report = run(args)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    from kvstrata.logs import configure_logging

    configure_logging("WARNING", json=False)
    main()
