"""kvstrata against transformers' continuous batching (``generate_batch``) on
the real default model, SmolLM2-135M-Instruct (GGUF), on a shared-prefix
chat workload: the same prompt token ids, greedy, the same number of new
tokens (EOS ignored on both sides, so both do the same work), tokens
compared. Prints JSON.

Like for like: transformers' continuous batching has no prefix cache, so
kvstrata is measured with prefix caching off as well as on; model loading is
outside every timing (a warm-up request runs on each side first).

    python tools/bench_vs_transformers.py [--requests 16] [--new-tokens 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig
from kvstrata.enginecore import AsyncEngine
from kvstrata.logs import configure_logging
from kvstrata.text.chat import chat_prompt
from kvstrata.text.tokenizer import load_tokenizer
from kvstrata.types import SamplingParams
from kvstrata.worker.model.smollm2 import locate_smollm2

CONTEXT = (
    "You are the help desk of a small library. The library opens at 9 am and closes at 6 pm on weekdays, "
    "and at 1 pm on Saturdays; it is closed on Sundays. Members may borrow up to five books for three "
    "weeks, renewable twice unless another member has reserved the book. Late returns cost ten cents a "
    "day per book. The reading room on the first floor is silent; group study rooms on the second floor "
    "can be booked for two hours at a time at the front desk. Printing costs five cents a page. "
) * 3
QUESTIONS = [
    "When do you open on Saturday?", "How many books can I borrow?", "How long is a loan?",
    "What does a late return cost?", "Where can I study in a group?", "How much is printing?",
    "Are you open on Sunday?", "Can I renew a book?", "How long can I book a study room?",
    "Is the reading room quiet?", "What time do you close on weekdays?", "Who books the study rooms?",
    "Can I renew a reserved book?", "How many renewals do I get?", "Where is the reading room?",
    "Do you charge for printing?",
]


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (asked again, #{i})")
        ids = chat_prompt(tokenizer, [{"role": "system", "content": CONTEXT}, {"role": "user", "content": q}])
        assert isinstance(ids, list)
        out.append(ids)
    return out


async def run_kvstrata(path: str, batch: list[list[int]], new_tokens: int, caching: bool) -> tuple[float, list]:
    cfg = EngineConfig(model=ModelConfig(model=path, max_model_len=2048), device="cpu", log_level="WARNING",
                       cache=CacheConfig(num_blocks=1024, enable_prefix_caching=caching))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine = await AsyncEngine.start(cfg)
    try:
        async def one(p):
            return [t async for o in engine.generate(p, params) for t in o.new_token_ids]

        await one(batch[0][:8])  # warm-up (and nothing of the workload's prefix cached)
        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(p) for p in batch))
        return time.perf_counter() - t0, out
    finally:
        await engine.aclose()


def run_transformers(path, batch: list[list[int]], new_tokens: int) -> tuple[float, list]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():
        model.generate_batch(inputs=[batch[0][:8]], generation_config=gen)  # warm-up
        t0 = time.perf_counter()
        res = model.generate_batch(inputs=batch, generation_config=gen)
        dt = time.perf_counter() - t0
    outs = [res[k].generated_tokens for k in sorted(res, key=lambda k: int(k.split("_")[-1]))]
    return dt, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (both sides)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    configure_logging("WARNING", json=False)
    path = locate_smollm2(download=True)
    tok = load_tokenizer(str(path))
    batch = prompts(tok, args.requests)
    kv_s, kv_out = asyncio.run(run_kvstrata(str(path), batch, args.new_tokens, caching=True))
    kv_nc_s, kv_nc_out = asyncio.run(run_kvstrata(str(path), batch, args.new_tokens, caching=False))
    hf_s, hf_out = run_transformers(path, batch, args.new_tokens)
    gen_tokens = args.requests * args.new_tokens
    print(json.dumps({
        "model": path.name, "requests": args.requests, "prompt_tokens": sum(map(len, batch)),
        "shared_prefix_tokens": min(len(p) for p in batch) - 12, "new_tokens_each": args.new_tokens,
        "threads": args.threads,
        "transformers_generate_batch_s": round(hf_s, 3),
        "kvstrata_prefix_cache_s": round(kv_s, 3),
        "kvstrata_no_prefix_cache_s": round(kv_nc_s, 3),
        "speedup_prefix_cache": round(hf_s / kv_s, 2),
        "speedup_like_for_like_no_cache": round(hf_s / kv_nc_s, 2),
        "tokens_per_s": {"transformers": round(gen_tokens / hf_s, 1), "kvstrata": round(gen_tokens / kv_s, 1),
                         "kvstrata_no_cache": round(gen_tokens / kv_nc_s, 1)},
        "identical_sequences": {"prefix_cache": sum(a == b for a, b in zip(kv_out, hf_out)),
                                "no_prefix_cache": sum(a == b for a, b in zip(kv_nc_out, hf_out)),
                                "of": args.requests},
    }, indent=2))


if __name__ == "__main__":
    main()
