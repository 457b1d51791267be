"""``kvstrata run | serve | bench``.

    kvstrata run                         the main job: engine subprocess, multi-turn chats, report
    kvstrata serve --port 8000           OpenAI-compatible HTTP server (SSE streaming)
    kvstrata serve --engines 4           ... over 4 engine subprocesses, KV-cache-aware routing
    kvstrata engine --listen tcp://0.0.0.0:5555 --credentials FILE
                                         one engine for a router on another machine
    kvstrata bench --target http ...     load test (same as tools/loadtest.py)

Every command takes the engine config from ``--config FILE.toml``, the
environment (``KVSTRATA_<SECTION>__<FIELD>``) and ``--<section>.<field>``
flags, validated at start (errors name the field).
"""

from __future__ import annotations

import argparse
import os
import sys

from kvstrata.config_io import ConfigError, add_config_args, load_config
from kvstrata.logs import configure_logging
from kvstrata.router.policy import POLICIES


def build_parser() -> argparse.ArgumentParser:
    from kvstrata.bench.runner import add_load_args
    from kvstrata.cli.commands import RUN_CPU_TIER_MIB, RUN_DEFAULTS, RUN_DEVICE_BLOCKS

    p = argparse.ArgumentParser(prog="kvstrata", description=__doc__.split("\n\n")[0])
    p.add_argument("--log-json", action="store_true", default=None, help="JSON log lines (default: when not a tty)")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="the main job: multi-turn chats against the engine subprocess")
    add_load_args(run, workload="chat", num=RUN_DEFAULTS["num_requests"])
    run.set_defaults(**{k: v for k, v in RUN_DEFAULTS.items() if k != "num_requests"})
    run.add_argument("--no-tiers", action="store_true", help="device prefix cache only (no CPU and disk tiers)")
    run.add_argument("--kv-store-dir", default=None,
                     help="disk tier directory (default: $KVSTRATA_CACHE_DIR/kv-store or ~/.cache/kvstrata/kv-store)")
    run.add_argument("--device-blocks", type=int, default=None, metavar="N",
                     help=f"device KV cache size in blocks of cache.block_size tokens (default with tiers: "
                          f"{RUN_DEVICE_BLOCKS}, less than a round of the chats, so the tiers serve hits; "
                          "cache.num_blocks or cache.kv_cache_memory_mib in the config win)")
    run.add_argument("--cpu-tier-mib", type=int, default=RUN_CPU_TIER_MIB,
                     help=f"CPU tier capacity in MiB (default {RUN_CPU_TIER_MIB}: less than the run's KV, "
                          "so the disk tier serves hits too)")
    run.add_argument("--disk-tier-mib", type=int, default=4096, help="disk tier capacity in MiB (default 4096)")
    add_config_args(run)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--transport", choices=("inproc", "ipc", "tcp"), default="ipc",
                       help="engine in this process, or as a subprocess over ZMQ ipc:// or tcp://")
    serve.add_argument("--engine-address", default=None,
                       help="connect to one running engine over ipc:// (for tcp:// use --engine with --credentials)")
    fleet = serve.add_argument_group("fleet (several engine replicas behind this server)")
    fleet.add_argument("--engines", type=int, default=1, metavar="N",
                       help="start N engine subprocesses on this machine, each with its own device cache and "
                            "tiers, routed by --router-policy (default 1: one engine, no router); on a CPU host the "
                            "engines divide the cores (threads per engine = cores // N, at least 1; "
                            "--model.num-threads wins)")
    fleet.add_argument("--engine", action="append", default=[], metavar="ADDR",
                       help="a running engine to route to (repeatable): tcp://HOST:PORT of "
                            "`kvstrata engine --listen`, or ipc://PATH")
    fleet.add_argument("--credentials", default=None, metavar="FILE",
                       help="the engines' CURVE key file (`kvstrata engine --credentials`), needed for tcp://")
    fleet.add_argument("--router-policy", choices=POLICIES, default="kv",
                       help="kv: least uncached prefill + load (default); least-loaded: least load, no cache "
                            "credit; session: by the request's `user`; round-robin")
    fleet.add_argument("--router-affinity", type=float, default=2.0, metavar="A",
                       help="kv policy: weigh each cached token A more against load (keeps conversations "
                            "where their prefix is; default %(default)s)")
    fleet.add_argument("--router-shared-fanout", type=int, default=2, metavar="N",
                       help="kv policy: a cached prefix that N different prompts have continued (a shared system "
                            "prompt) counts as held by every engine, so new conversations go by load; 0: never "
                            "(default %(default)s)")
    fleet.add_argument("--registry", default=None, metavar="URL",
                       help="find engines registered in Redis (redis://HOST:PORT or "
                            "redis-cluster://HOST:PORT,HOST:PORT,...; rediss:// and rediss-cluster://...?"
                            "ssl_ca_certs=FILE over TLS) and follow them as they come and go")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--default-max-tokens", type=int, default=16)
    serve.add_argument("--backlog", type=int, default=2048,
                       help="HTTP listen backlog: connections queued before accept (default 2048; "
                            "the kernel caps it at net.core.somaxconn)")
    add_config_args(serve)

    engine = sub.add_parser("engine", help="run one engine for routers on other machines (tcp://, CURVE keys)")
    engine.add_argument("--listen", required=True, metavar="tcp://HOST:PORT",
                        help="where routers connect (ipc://PATH for the same machine)")
    engine.add_argument("--credentials", default=None, metavar="FILE",
                        help="CURVE key file for tcp:// (created, mode 0600, when missing); copy it to the "
                             "routers' machines and pass it to `kvstrata serve --credentials`")
    engine.add_argument("--registry", default=None, metavar="URL",
                        help="register in Redis (redis://HOST:PORT or redis-cluster://HOST:PORT,...; "
                             "rediss:// and rediss-cluster://...?ssl_ca_certs=FILE over TLS) with a TTL "
                             "refreshed by heartbeat, so routers find this engine")
    engine.add_argument("--advertise", default=None, metavar="tcp://HOST:PORT",
                        help="the address routers should use (default: --listen)")
    engine.add_argument("--engine-id", default=None, help="the name in the registry (default HOST:PORT)")
    add_config_args(engine)

    bench = sub.add_parser("bench", help="load test: in-process, ZMQ or HTTP")
    add_load_args(bench)
    add_config_args(bench)
    return p


def quiet_waiting_threads() -> None:
    """Unless set already: OpenMP threads that sleep rather than spin while
    they wait (``OMP_WAIT_POLICY=PASSIVE``), for this process and the engine
    subprocesses it starts (set before torch loads OpenMP). On a busy 2-core
    host, SmolLM2's decode step of 4 requests took 3.5-4.5 s with torch's
    two threads spinning for cores they did not get, 0.24 s with them
    sleeping (0.35 s with one thread)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> int:
    quiet_waiting_threads()
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args=args)
    except ConfigError as e:
        print(f"kvstrata {args.command}: config error: {e}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, json=args.log_json)
    from kvstrata.cli import commands

    try:
        config = commands.resolve_model(config)
    except ValueError as e:  # CheckpointError: not installed, and could not download
        print(f"kvstrata {args.command}: {e}", file=sys.stderr)
        return 2

    if args.command == "serve":
        return commands.run_async(commands.serve(args, config))
    if args.command == "engine":
        return commands.run_async(commands.engine(args, config))
    if args.command == "bench":
        return commands.bench(args, config)
    return commands.run_main_job(args, config)


if __name__ == "__main__":
    sys.exit(main())
