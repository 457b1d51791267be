"""One load test from parsed arguments: build the workload, open the target
(in-process engine, engine subprocess over ZMQ, or HTTP), run, report.
Shared by ``tools/loadtest.py``, ``kvstrata bench`` and ``kvstrata run``."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
import msgspec
import structlog

from kvstrata.config import EngineConfig
from kvstrata.enginecore.client import EngineClient, served_model_name
from kvstrata.bench import workloads as W
from kvstrata.bench.driver import TURN_ORDERS, LoadResult, run_load
from kvstrata.bench.report import build_report, write_plots
from kvstrata.bench.targets import EngineTarget, HttpTarget, LoadTarget
from kvstrata.bench.transcripts import Report

log = structlog.get_logger(__name__)
TARGETS = ("inproc", "zmq", "http")


def add_load_args(p: argparse.ArgumentParser, *, workload: str = "random", num: int = 64) -> None:
    g = p.add_argument_group("load test")
    g.add_argument("--target", choices=TARGETS, default="zmq",
                   help="inproc: AsyncEngine here; zmq: engine subprocess; http: an OpenAI server")
    g.add_argument("--transport", choices=("ipc", "tcp"), default="ipc", help="ZMQ transport (zmq, http)")
    g.add_argument("--address", default=None, help="zmq: connect to this running engine instead of starting one")
    g.add_argument("--url", default=None, help="http: base URL of a running server (else one is started here)")
    g.add_argument("--workload", choices=tuple(W.WORKLOADS), default=workload)
    g.add_argument("--num-requests", type=int, default=num, help="requests, or conversations for multi-turn")
    g.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    g.add_argument("--input-len", type=_range, default=(32, 128), metavar="LO:HI", help="user message words")
    g.add_argument("--output-len", type=_range, default=(16, 64), metavar="LO:HI", help="max tokens per turn")
    g.add_argument("--prefix-len", type=int, default=256, help="shared system prompt words")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    g.add_argument("--trace", default=None, metavar="FILE", help="trace: JSONL with arrival times")
    g.add_argument("--rate", type=float, default=None, help="Poisson arrivals, conversations/s (default: all at once)")
    g.add_argument("--concurrency", type=int, default=32,
                   help="max conversations in flight, or requests with --turn-order round (0: unlimited)")
    g.add_argument("--turn-order", choices=TURN_ORDERS, default="conversation",
                   help="conversation: each conversation's turns back to back; round: every conversation's "
                        "turn k before any turn k+1 (users who come back after others spoke)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--output", default=None, metavar="FILE", help="write the JSON report here")
    g.add_argument("--plot-dir", default=None, metavar="DIR", help="PNG plots (needs matplotlib)")
    g.add_argument("--no-progress", action="store_true")


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI or N, got {text!r}") from None
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return a, b


def make_workload(args: argparse.Namespace) -> list[W.Conversation]:
    n, seed = args.num_requests, args.seed
    match args.workload:
        case "random":
            return W.random_lengths(n, input_len=args.input_len, output_len=args.output_len, seed=seed)
        case "shared-prefix":
            return W.shared_prefix(n, num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
                                   input_len=args.input_len, output_len=args.output_len, seed=seed)
        case "multi-turn":
            return W.multi_turn(n, turns=args.turns, system_len=args.prefix_len, input_len=args.input_len,
                                output_len=args.output_len, seed=seed)
        case "chat":
            return W.chat(n, turns=args.turns, output_len=args.output_len, seed=seed)
        case "sharegpt":
            return W.sharegpt(n, max_turns=args.turns, max_output_tokens=args.output_len[1], seed=seed)
        case "trace":
            if not args.trace:
                raise ValueError("--trace FILE is required for the trace workload")
            return W.trace(args.trace, seed=seed)
    raise ValueError(f"workload: unknown {args.workload!r}")


@contextlib.asynccontextmanager
async def open_target(args: argparse.Namespace, config: EngineConfig) -> AsyncIterator[LoadTarget]:
    """Yield a target; everything it started is stopped on exit."""
    from kvstrata.ipc.engines import connect_engine, open_engine

    if args.target == "http" and args.url:
        target = HttpTarget(args.url, connections=0)
        try:
            yield target
        finally:
            await target.aclose()
        return
    if args.address:
        if args.target == "inproc":
            raise ValueError("--address: an engine address needs --target zmq or http, not inproc")
        engine = await connect_engine(args.address)
    else:
        engine = await open_engine(config, "inproc" if args.target == "inproc" else args.transport)
    try:
        if args.target != "http":
            yield EngineTarget(engine, args.target)
            return
        async with _local_http(engine, config) as url:
            target = HttpTarget(url, connections=0)
            try:
                yield target
            finally:
                await target.aclose()
    finally:
        await engine.aclose()


@contextlib.asynccontextmanager
async def _local_http(engine: EngineClient, config: EngineConfig) -> AsyncIterator[str]:
    from kvstrata.ipc.addresses import free_port
    from kvstrata.api_server.server import OpenAIServer, run_http_server

    port = free_port()
    server = OpenAIServer(engine, model_name=model_name(config))
    runner = await run_http_server(server, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def model_name(config: EngineConfig) -> str:
    return served_model_name(config)


async def run_bench(args: argparse.Namespace, config: EngineConfig, convs: list[W.Conversation], *,
                    desc: str = "requests") -> tuple[Report, LoadResult]:
    """Run the load; the caller writes the outputs (``save_outputs``) off the loop."""
    async with open_target(args, config) as target:
        before = await target.stats()
        result = await run_load(target, convs, rate=args.rate, concurrency=args.concurrency,
                                temperature=args.temperature, progress=not args.no_progress,
                                seed=args.seed, desc=desc, turn_order=args.turn_order)
        after = await target.stats()
    report = build_report(result, before, after, target=args.target, workload=args.workload,
                          num_conversations=len(convs), rate=args.rate, concurrency=args.concurrency,
                          executor=config.executor, model=model_name(config))
    return report, result


def save_outputs(args: argparse.Namespace, report: Report, result: LoadResult) -> None:
    """JSON report file and plots, when asked for (synchronous: after the loop)."""
    if args.plot_dir:
        report["plots"] = write_plots(result, args.plot_dir) or "matplotlib not installed: no plots"
    if args.output:
        with open(args.output, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(report), indent=2))
