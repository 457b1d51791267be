"""The bodies of ``kvstrata serve | bench | run`` (argument parsing is in
``kvstrata.cli``). Each is called once per process with logging configured."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

import msgspec
import structlog

from kvstrata.config import CacheConfig, EngineConfig, KVTransferConfig
from kvstrata.enginecore.client import EngineClient
from kvstrata.errors import EngineDeadError
from kvstrata.bench import workloads as W
from kvstrata.bench.report import format_report
from kvstrata.bench.runner import make_workload, model_name, run_bench, save_outputs

log = structlog.get_logger(__name__)
_T = TypeVar("_T")

# `kvstrata run`'s workload and KV sizes. 12 chats of 3 turns, 4 requests at
# a time, in rounds (each round in a seeded shuffled order): a chat's next
# turn comes after some of the others spoke, so a 48-block device cache has
# kept some histories and evicted others (the system prompt, used by every
# request, stays). The evicted ones come back from the CPU tier or, past its
# 32 MiB (SmolLM2's KV is 45 KiB a token), from disk: on this workload about
# 8% and 17% of the tokens the device missed. Chunks of one block (16
# tokens), since a turn adds only a few dozen tokens to a chat; every chunk
# saved (save_admission "all", where a server's default keeps one-off
# chunks off the disk), so the next run, with the same seed and so the same
# chats, finds the whole run on disk.
RUN_DEFAULTS = dict(num_requests=12, workload="chat", turns=3, output_len=(8, 32), input_len=(8, 24),
                    prefix_len=48, concurrency=4, turn_order="round")
RUN_DEVICE_BLOCKS = 48
RUN_CPU_TIER_MIB = 32
RUN_CHUNK_TOKENS = 16


def run_async(coro: Coroutine[Any, Any, _T]) -> _T:  # Any: the coroutine's yield and send types, as asyncio.run's
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


# --- serve ---------------------------------------------------------------------------


async def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    from kvstrata.ipc.engines import connect_engine, open_engine
    from kvstrata.api_server.server import OpenAIServer, run_http_server

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    engine: EngineClient
    try:
        if args.engines > 1 or args.engine or args.registry:
            engine = await open_fleet(args, config)
        elif args.engine_address:
            engine = await connect_engine(args.engine_address)
        else:
            engine = await open_engine(config, args.transport)
    except (ValueError, EngineDeadError) as e:
        print(f"kvstrata serve: {e}", file=sys.stderr)
        return 2
    code = 0
    try:
        server = OpenAIServer(engine, model_name=args.served_model_name or engine.model_name,
                              default_max_tokens=args.default_max_tokens)
        runner = await run_http_server(server, args.host, args.port, backlog=args.backlog)
        try:
            while not stop.is_set():
                try:
                    async with asyncio.timeout(1.0):
                        await stop.wait()
                except TimeoutError:
                    if engine.is_dead:
                        log.error("serve_engine_dead_exiting")
                        code = 1
                        break
        finally:
            await runner.cleanup()
    finally:
        await engine.aclose()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    log.info("serve_stopped", exit_code=code)
    return code


async def open_fleet(args: argparse.Namespace, config: EngineConfig) -> EngineClient:
    """``--engines N`` local engine subprocesses and the ``--engine`` addresses
    (and, with ``--registry``, the engines registered there), behind the
    KV-cache-aware router."""
    from kvstrata.fleet import FleetClient, Replica, local_connector, remote_connector
    from kvstrata.ipc import keyfile
    from kvstrata.router import RouterConfig

    if args.engines < 1:
        raise ValueError(f"--engines must be >= 1, got {args.engines}")
    if args.engine_address:
        raise ValueError("--engine-address joins one engine; use --engine ADDR (repeatable) for a fleet")
    credentials = None
    if any(a.startswith("tcp://") for a in args.engine) or args.registry:
        if args.credentials is None:
            raise ValueError("tcp:// engines need their key file: --credentials FILE "
                             "(the one `kvstrata engine --credentials` wrote)")
        credentials = keyfile.load(args.credentials).for_client()
    replicas = []
    if args.engines > 1 or not (args.engine or args.registry):
        transport = "ipc" if args.transport == "inproc" else args.transport
        local = engines_config(config, args.engines)
        replicas += [Replica(f"engine-{i}", "local", local_connector(local, transport)) for i in range(args.engines)]
    for address in args.engine:
        replicas.append(Replica(address, "remote", remote_connector(address, credentials), address=address))
    fleet_config = RouterConfig(policy=args.router_policy, affinity=args.router_affinity,
                                shared_prefix_fanout=args.router_shared_fanout)
    if args.registry:
        from kvstrata.fleet.discovery import follow_registry

        return await follow_registry(args.registry, replicas, fleet_config, credentials)
    return await FleetClient.start(replicas, fleet_config)


def engines_config(config: EngineConfig, num_engines: int, *, cores: int | None = None,
                   on_cpu: bool | None = None) -> EngineConfig:
    """The config of each of ``num_engines`` local engines on this host. On a
    CPU host the engines divide the cores this process may run on (at least
    one torch thread each), instead of each taking torch's default of every
    core: two engines on two cores at two threads each run 10x slower than
    one. An explicit ``model.num_threads`` wins; one engine, or engines on a
    GPU, keep the config as it is. ``cores``/``on_cpu``: this host's (tests)."""
    if num_engines <= 1 or config.model.num_threads is not None:
        return config
    if on_cpu is None:
        on_cpu = _engines_on_cpu(config.device)
    if not on_cpu:
        return config
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // num_engines)
    log.info("fleet_engines_share_cores", engines=num_engines, cores=cores, threads_per_engine=threads,
             hint="--model.num-threads N sets it yourself")
    return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, num_threads=threads))


def _engines_on_cpu(device: str) -> bool:
    if device == "cpu":
        return True
    if device.startswith("cuda"):
        return False
    import torch  # "auto": only here, and only for several local engines

    return not torch.cuda.is_available()


# --- engine (one engine for remote routers) ----------------------------------------------


async def engine(args: argparse.Namespace, config: EngineConfig) -> int:
    from kvstrata.ipc import keyfile
    from kvstrata.ipc.addresses import check_address
    from kvstrata.ipc.engine_proc import serve_engine
    from kvstrata.ipc.protocol import Credentials

    try:
        if args.listen.startswith("tcp://"):
            if args.credentials is None:
                raise ValueError("--listen tcp:// needs --credentials FILE (created when missing)")
            credentials = keyfile.load_or_create(args.credentials)
        else:
            credentials = Credentials.new(curve=False)
        address = check_address(args.listen, allow_remote=credentials.curve)
    except ValueError as e:
        print(f"kvstrata engine: {e}", file=sys.stderr)
        return 2
    config = msgspec.structs.replace(config, cache=msgspec.structs.replace(config.cache, enable_kv_events=True))
    registration = None
    if args.registry:
        from kvstrata.fleet.discovery import register_engine

        registration = register_engine(args.registry, args.advertise or address, args.engine_id, config)
    return await serve_engine(config, address, credentials, registration=registration)


# --- bench -----------------------------------------------------------------------------


def bench(args: argparse.Namespace, config: EngineConfig) -> int:
    try:
        convs = make_workload(args)
    except W.WorkloadUnavailable as e:
        print(f"kvstrata bench: {e}", file=sys.stderr)
        return 2
    report, result = run_async(run_bench(args, config, convs))
    save_outputs(args, report, result)
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(report), indent=2).decode() + "\n")
    return 0 if report["num_errors"] == 0 else 1


# --- run (the main job) ---------------------------------------------------------------


def with_tiers(config: EngineConfig, args: argparse.Namespace) -> tuple[EngineConfig, str]:
    """The main job's KV tiers: the device prefix cache, then CPU memory, then
    local disk (``--kv-store-dir``, default ``$KVSTRATA_CACHE_DIR/kv-store`` or
    ``~/.cache/kvstrata/kv-store``). The disk index is rebuilt at start, so a
    later run hits what an earlier one stored. A ``kv_transfer`` section given
    in the config (TOML, env, flags) is used as it is; ``--no-tiers`` or the
    null executor (which runs no model, so has no KV to move) keep the device
    cache alone. With tiers, the device cache is ``--device-blocks`` blocks
    unless the config sizes it."""
    if config.kv_transfer is not None:
        return config, f"device prefix cache + the {config.kv_transfer.connector!r} connector from the config"
    if args.no_tiers or config.executor != "model":
        return config, "device prefix cache only"
    root = os.path.abspath(kv_store_dir(args))
    options = {
        "chunk_size": RUN_CHUNK_TOKENS,
        "save_admission": "all",
        "store": {
            "save_partial_chunks": True,
            "cpu": {"capacity_bytes": args.cpu_tier_mib << 20},
            "tiers": [{"type": "disk", "options": {"path": root, "capacity_bytes": args.disk_tier_mib << 20}}],
        },
    }
    config = with_device_blocks(config, args.device_blocks)
    config = msgspec.structs.replace(config, kv_transfer=KVTransferConfig(connector="offload", options=options))
    device = (f"{config.cache.num_blocks} blocks = {(config.cache.num_blocks - 1) * config.cache.block_size} tokens"
              if config.cache.num_blocks else f"{config.cache.kv_cache_memory_mib} MiB")
    return config, (f"device prefix cache ({device}) + CPU tier ({args.cpu_tier_mib} MiB) "
                    f"+ disk tier ({args.disk_tier_mib} MiB at {root}: {stored_note(root)})")


def kv_store_dir(args: argparse.Namespace) -> str:
    return args.kv_store_dir or os.path.join(
        os.environ.get("KVSTRATA_CACHE_DIR") or os.path.expanduser("~/.cache/kvstrata"), "kv-store")


def with_device_blocks(config: EngineConfig, blocks: int | None) -> EngineConfig:
    """``blocks`` device KV blocks (``RUN_DEVICE_BLOCKS`` when None), unless
    the config sized the cache itself. The default model's context (8192)
    is capped at what the pool holds here, as the builder would do with a
    warning; another model's maximum is known only once it is loaded."""
    cache = config.cache
    if blocks is None:
        if cache.num_blocks is not None or cache.kv_cache_memory_mib != CacheConfig().kv_cache_memory_mib:
            return config
        blocks = RUN_DEVICE_BLOCKS
    if blocks < 2:
        raise ValueError(f"--device-blocks must be >= 2, got {blocks}")
    model = config.model
    pool_tokens = (blocks - 1) * cache.block_size
    if model.max_model_len is None and (model.model or "").endswith(".gguf"):
        from kvstrata.worker.model.smollm2 import GGUF_NAME  # imported by resolve_model already

        if os.path.basename(model.model or "") == GGUF_NAME:
            model = msgspec.structs.replace(model, max_model_len=pool_tokens)
    return msgspec.structs.replace(config, cache=msgspec.structs.replace(cache, num_blocks=blocks), model=model)


def stored_note(root: str) -> str:
    """What earlier runs left in the disk tier's directory."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(dirpath, name)).st_size
    return f"{total / 2**20:.1f} MiB stored by earlier runs" if total else "empty"


WORKLOAD_NOTES = {
    "chat": "chats of real questions behind one system prompt (seeded: the same every run)",
    "multi-turn": "synthetic multi-turn chats",
    "sharegpt": "ShareGPT V3 conversations",
}


def run_main_job(args: argparse.Namespace, config: EngineConfig) -> int:
    try:
        config, tiers_note = with_tiers(config, args)
        convs = make_workload(args)
    except (ValueError, W.WorkloadUnavailable) as e:
        print(f"kvstrata run: {e}", file=sys.stderr)
        return 2
    source = WORKLOAD_NOTES.get(args.workload, f"the {args.workload} workload")
    print(f"kvstrata run: {len(convs)} conversations, {sum(len(c.turns) for c in convs)} requests: {source}, "
          f"{args.concurrency or 'all'} at a time, in {args.turn_order} order\n"
          f"  engine: {model_name(config)} ({config.executor} executor, device {config.device}) "
          f"over {args.target}\n  KV: {tiers_note}", flush=True)
    report, result = run_async(run_bench(args, config, convs, desc="turns"))
    report["tiers"] = tiers_note
    save_outputs(args, report, result)
    print(format_report(report), flush=True)
    if "disk" in (report.get("prefix_cache") or {}) and args.workload == "chat":
        print("The disk tier keeps what this run computed: run it again (same --kv-store-dir) and the same "
              "chats are found there ('hit rate disk').", flush=True)
    return 0 if report["num_errors"] == 0 else 1


def resolve_model(config: EngineConfig) -> EngineConfig:
    """The CLI's model names: none given or ``smollm2`` is the real default
    model, SmolLM2-135M-Instruct (its GGUF, fetched into the cache once);
    ``random`` is the seeded random model (tests, no download). The null
    executor runs no model: it keeps the random one's shapes."""
    name = config.model.model
    if name == "random" or (name is None and config.executor != "model"):
        return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, model=None))
    if name is None or name == "smollm2":
        from kvstrata.worker.model.smollm2 import locate_smollm2

        path = str(locate_smollm2(download=True))
        return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, model=path))
    return config
