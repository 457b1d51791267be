"""kvstrata.serve: the engine as a ZMQ subprocess, its multiprocess client,
the OpenAI-compatible HTTP server and the load-test tooling.

    protocol.py        wire messages (msgspec tagged unions, msgpack)
    engine_proc.py     the subprocess entry point; engine_server.py its ROUTER side
    mp_client.py       MPEngineClient: the AsyncEngine API over ZMQ
    launcher.py        spawning the subprocess, watching it (pidfd)
    addresses.py       ipc:// in a 0700 directory, tcp:// on loopback
    engines.py         open_engine(config, transport): one switch for all transports
    http_server.py     `kvstrata serve` (openai_types.py, metrics.py)
    bench/             workloads, targets, driver, report (`kvstrata bench`, tools/loadtest.py)
    cli_commands.py    the bodies of `kvstrata run | serve | bench`

Nothing here is imported by ``kvstrata`` itself; import what you use.
"""
