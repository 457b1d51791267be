"""Disaggregated prefill on one machine: two engine processes sharing a Redis
tier (prints JSON; never asserts).

    orchestrator ──prompt──► prefill engine (role "producer": computes the
                             prompt, 1 token, saves its KV to Redis, flushes)
                 ◄──ack────
                 ──prompt──► decode engine  (role "consumer": finds the prompt's
                             KV in Redis, loads it asynchronously while waiting in
                             WAITING_FOR_REMOTE_KVS, then generates)
                 ◄─tokens──

Both engines are separate OS processes running the same model (the default
seeded model, or ``--model``); they agree on every chunk key through the
deterministic cache identity. Partial chunks are stored too, so only the
prompt's last token is computed by the decode engine. For comparison the
decode engine also serves, for each request, a prompt of the same length
that nobody prefilled ("cold").

Reported: per request, TTFT on the decode engine with and without the
prefill engine's KV, the tokens loaded from Redis, and whether the decode
engine's first token equals the prefill engine's (both greedy).

    python tools/disagg_prefill.py [--requests 4 --prompt-tokens 512 --output-tokens 16]
                                   [--redis-port PORT]   (default: start a redis-server)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from kvstrata.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from kvstrata.enginecore import AsyncEngine, SamplingParams
from kvstrata.logs import configure_logging


def transfer_config(role: str, port: int, chunk_size: int) -> KVTransferConfig:
    redis = {"type": "redis", "name": "redis", "options": {"host": "127.0.0.1", "port": port}}
    return KVTransferConfig(connector="offload", role=role, options={
        "chunk_size": chunk_size,
        "store": {"cpu": {"capacity_bytes": 256 << 20}, "tiers": [redis], "save_partial_chunks": True},
    })


async def serve(args: argparse.Namespace) -> None:
    """One engine process: JSON lines in on stdin, JSON lines out on stdout."""
    role = "producer" if args.serve == "prefill" else "consumer"
    config = EngineConfig(model=ModelConfig(model=args.model), log_level="WARNING",
                          cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks),
                          kv_transfer=transfer_config(role, args.redis_port, args.chunk_size))
    loop = asyncio.get_running_loop()
    async with await AsyncEngine.start(config) as engine:
        print(json.dumps({"ready": True}), flush=True)
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            req = json.loads(line)
            params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
            before = (await engine.stats()).extra.get("kv.external_hit_tokens", 0.0)
            t0 = time.perf_counter()
            ttft, tokens = None, []
            async for out in engine.generate(req["prompt"], params, request_id=req["id"]):
                if out.new_token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens.extend(out.new_token_ids)
            await engine.flush_kv()  # the prefill engine's KV is in Redis before it answers
            hit = (await engine.stats()).extra.get("kv.external_hit_tokens", 0.0) - before
            print(json.dumps({"id": req["id"], "ttft_s": ttft, "tokens": tokens, "external_hit_tokens": hit,
                              "total_s": time.perf_counter() - t0}), flush=True)


class Peer:
    """An engine process spoken to in JSON lines."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, role: str, args: argparse.Namespace, port: int) -> Peer:
        cmd = [sys.executable, __file__, "--serve", role, "--redis-port", str(port),
               "--block-size", str(args.block_size), "--num-blocks", str(args.num_blocks),
               "--chunk-size", str(args.chunk_size)]
        if args.model:
            cmd += ["--model", args.model]
        proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE)
        peer = cls(proc)
        await peer.read()  # {"ready": true}
        return peer

    async def ask(self, msg: dict) -> dict:
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        await self.proc.stdin.drain()
        return await self.read()

    async def read(self) -> dict:
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), 600)
            if not line:
                raise RuntimeError("engine process exited")
            if line.startswith(b"{"):
                return json.loads(line)

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 60)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def start_redis(workdir: str) -> tuple[subprocess.Popen, int]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.02)


async def orchestrate(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    redis_proc, port = None, args.redis_port
    with tempfile.TemporaryDirectory(prefix="kvstrata-disagg-") as tmp:
        if port is None:
            redis_proc, port = start_redis(tmp)
        prefill = decode = None
        try:
            prefill, decode = await asyncio.gather(Peer.start("prefill", args, port), Peer.start("decode", args, port))
            results = []
            for i in range(args.requests):
                p = [rng.randint(1, 255) for _ in range(args.prompt_tokens)]
                cold = [rng.randint(1, 255) for _ in range(args.prompt_tokens)]
                pre = await prefill.ask({"id": f"p{i}", "prompt": p, "max_tokens": 1})
                warm = await decode.ask({"id": f"d{i}", "prompt": p, "max_tokens": args.output_tokens})
                base = await decode.ask({"id": f"c{i}", "prompt": cold, "max_tokens": args.output_tokens})
                results.append({
                    "prefill_s": round(pre["total_s"], 4), "decode_ttft_s": round(warm["ttft_s"], 4),
                    "cold_ttft_s": round(base["ttft_s"], 4),
                    "loaded_from_redis_tokens": int(warm["external_hit_tokens"]),
                    "first_token_matches_prefill": warm["tokens"][:1] == pre["tokens"][:1],
                    "tokens": warm["tokens"],
                })
        finally:
            for peer in (prefill, decode):
                if peer is not None:
                    await peer.close()
            if redis_proc is not None:
                redis_proc.kill()
                redis_proc.wait()
    ttft = sorted(r["decode_ttft_s"] for r in results)
    cold = sorted(r["cold_ttft_s"] for r in results)
    return {
        "tool": "disagg_prefill", "requests": args.requests, "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens, "chunk_size": args.chunk_size,
        "decode_ttft_p50_s": ttft[len(ttft) // 2], "cold_ttft_p50_s": cold[len(cold) // 2],
        "all_first_tokens_match": all(r["first_token_matches_prefill"] for r in results),
        "results": results,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--redis-port", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve", choices=["prefill", "decode"], default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging("WARNING", json=False)  # logs on stderr; stdout is the JSON report
    if args.serve:
        asyncio.run(serve(args))
        return
    report = asyncio.run(orchestrate(args))
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
