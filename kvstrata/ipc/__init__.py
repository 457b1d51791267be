"""kvstrata.ipc: the engine as a ZMQ subprocess and its multiprocess client.

    protocol.py        wire messages (msgspec tagged unions, msgpack)
    engine_proc.py     the subprocess entry point; engine_server.py its ROUTER side
    mp_client.py       MPEngineClient: the EngineClient API over ZMQ
    launcher.py        spawning the subprocess, watching it (pidfd)
    addresses.py       ipc:// in a 0700 directory, tcp:// on loopback
    engines.py         open_engine(config, transport): one switch for all transports
    kv_publisher.py    KV cache events over ZMQ PUB, with replay over ROUTER: its
                       thread binds on ``await start()``; the process starting
                       the engine hands it to ``AsyncEngine.start(kv_events=...)``
    zmq_io.py          socket helpers
"""
