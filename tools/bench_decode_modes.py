"""Benchmark: async scheduling and speculative decoding, on vs off, same
machine, same run. Prints JSON.

    python tools/bench_decode_modes.py [--model smollm2|random|PATH] [--rounds 2]

Cases (each measured with the feature off and on, alternating, ``--rounds``
times; the figure is the median; greedy, so every pair must produce the same
tokens, which is checked):

* ``async_scheduling``: ``--concurrency`` requests decoding together (many
  running requests: where overlapping the scheduler's work with the model
  step matters), output tokens per second;
* ``spec_repetitive``: chat requests asking the model to copy a given text
  (the output repeats the prompt: n-gram drafts are accepted), output tokens
  per second, acceptance rate, mean accepted length;
* ``spec_non_repetitive``: chat requests asking for new text (few drafts
  match), output tokens per second: the cost of speculation when it does not
  pay.

The model defaults to SmolLM2-135M-Instruct (the GGUF the CLI uses, found or
fetched once); ``--model random`` runs the seeded random model (no chat
template: the same prompts as token ids).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig  # noqa: E402
from kvstrata.enginecore.async_engine import AsyncEngine  # noqa: E402
from kvstrata.types import SamplingParams  # noqa: E402

TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, "
        "the members agreed to fund the reading room, the children's section and a small garden, but they "
        "postponed the decision on the café until the spring, when the final costs of the building are known.")
COPY = f"Copy the following text exactly, word for word, and write nothing else:\n\n{TEXT}"
FRESH = ["Write a short poem about the sea at night.", "Explain why the sky is blue to a child.",
         "Give three ideas for a weekend trip in the mountains.", "Describe your ideal breakfast."]


def model_path(name: str) -> str | None:
    if name == "random":
        return None
    if name == "smollm2":
        from kvstrata.worker.model.smollm2 import locate_smollm2

        return str(locate_smollm2(download=True))
    return name


SPEC = {"k": 2, "min": 2, "max": 4}


def engine_config(path: str | None, *, async_on: bool, spec: bool, threads: int) -> EngineConfig:
    return EngineConfig(
        device="cpu", log_level="WARNING",
        model=ModelConfig(model=path, num_threads=threads, max_model_len=2048),
        cache=CacheConfig(block_size=16, num_blocks=2048),
        scheduler=SchedulerConfig(async_scheduling=async_on, max_num_batched_tokens=4096),
        speculative=SpeculativeConfig(method="ngram" if spec else None, num_speculative_tokens=SPEC["k"],
                                      prompt_lookup_min=SPEC["min"], prompt_lookup_max=SPEC["max"]),
    )


async def run_case(config: EngineConfig, prompts: list, max_tokens: int) -> dict:
    engine = await AsyncEngine.start(config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    try:
        async def one(p) -> list[int]:
            gen = engine.chat(p, params) if isinstance(p, list) and p and isinstance(p[0], dict) \
                else engine.generate(p, params)
            return [t async for o in gen for t in o.new_token_ids]

        await one(prompts[0])  # warm-up (and the prefix cache: both sides get it)
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        dt = time.perf_counter() - t0
        extra = (await engine.stats()).extra
    finally:
        await engine.aclose()
    n = sum(len(o) for o in outs)
    res = {"output_tokens": n, "seconds": round(dt, 3), "tokens_per_s": round(n / dt, 1), "outputs": outs}
    if "spec.num_draft_tokens" in extra:
        res.update({k: round(v, 3) for k, v in extra.items() if k.startswith("spec.")})
    return res


async def compare(name: str, path, prompts, max_tokens: int, rounds: int, threads: int, *, field: str) -> dict:
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            cfg = engine_config(path, async_on=on if field == "async" else False,
                                spec=on if field == "spec" else False, threads=threads)
            runs[on].append(await run_case(cfg, prompts, max_tokens))
    same = all(a["outputs"] == b["outputs"] for a in runs[False] for b in runs[True])
    off = statistics.median(x["tokens_per_s"] for x in runs[False])
    on = statistics.median(x["tokens_per_s"] for x in runs[True])
    last_on = {k: v for k, v in runs[True][-1].items() if k.startswith("spec.")}
    return {"case": name, "off_tokens_per_s": off, "on_tokens_per_s": on, "gain": round(on / off, 3),
            "same_tokens": same, "output_tokens": runs[True][-1]["output_tokens"], **last_on,
            "runs_off": [x["tokens_per_s"] for x in runs[False]], "runs_on": [x["tokens_per_s"] for x in runs[True]]}


async def main_async(args: argparse.Namespace) -> dict:
    path = model_path(args.model)
    chat = path is not None
    copy = [[{"role": "user", "content": COPY}] for _ in range(args.spec_concurrency)] if chat else \
        [[(i * 37 + k) % 200 + 3 for i in range(60)] * 2 for k in range(args.spec_concurrency)]
    fresh = [[{"role": "user", "content": FRESH[k % len(FRESH)]}] for k in range(args.spec_concurrency)] if chat \
        else [[(i * 7919 + k * 13) % 251 + 3 for i in range(60)] for k in range(args.spec_concurrency)]
    many = [[(i * 31 + k * 17) % 250 + 3 for i in range(32)] for k in range(args.concurrency)]
    SPEC.update(k=args.num_speculative_tokens, min=args.prompt_lookup_min, max=args.prompt_lookup_max)
    plan = {"async_scheduling": (many, args.decode_tokens, "async"), "spec_repetitive": (copy, args.spec_tokens, "spec"),
            "spec_non_repetitive": (fresh, args.spec_tokens, "spec")}
    cases = [await compare(name, path, prompts, n, args.rounds, args.threads, field=field)
             for name, (prompts, n, field) in plan.items() if name in args.cases]
    return {"model": args.model, "torch_threads": args.threads, "rounds": args.rounds, "speculative": dict(SPEC),
            "cases": cases}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (default), random, or a checkpoint path")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--concurrency", type=int, default=32, help="requests decoding together (async case)")
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--spec-concurrency", type=int, default=4)
    ap.add_argument("--spec-tokens", type=int, default=96)
    ap.add_argument("--num-speculative-tokens", type=int, default=2)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--cases", nargs="+", default=["async_scheduling", "spec_repetitive", "spec_non_repetitive"])
    args = ap.parse_args(argv)
    report = asyncio.run(main_async(args))
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(report), indent=2).decode() + "\n")
    return report


if __name__ == "__main__":
    from kvstrata.logs import configure_logging

    configure_logging("WARNING", json=False)  # logs on stderr; stdout is the JSON report
    main()
