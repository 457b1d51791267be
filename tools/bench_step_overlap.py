"""How much of the host's work per step hides behind the device's: the
engine's real host work (scheduler, input batch, sampler, outputs, the
event loop, the step thread) against a simulated device. Prints JSON.

    python tools/bench_step_overlap.py [--quick] [--batches 1,64] [--device-ms 3]
                                       [--steps 200] [--modes serial,async,pipelined]
                                       [--transports inproc,ipc]

The model's forward (and its logits: the lm_head's matmul and the
sampler's argmax over the vocabulary are device work) is replaced by a
simulated device queue: a launch
returns at once and occupies the device for ``--device-ms`` after whatever
it queued before; reading the sampled tokens back (the sampler's ``tolist``
on the serial path, ``PendingStep.result`` on the pipelined one) waits,
without the GIL, until the device is done, as a CUDA synchronize does. So
``ms_per_step / device_ms`` is 1.0 when the host's work hides completely and
grows with the host work left on the critical path. Modes: serial (one step
at a time), async (``scheduler.async_scheduling``: step N+1 scheduled while
N runs), pipelined (``scheduler.pipelined_steps``: N+1 launched before N's
tokens are read back). ``host_only`` runs with a device time of ~0: the
host's own cost per step. The tiny model's real forward never runs, so
this measures no kernel; it is a CPU stand-in for the GPU's idle gaps
(tools/bench_gpu.py measures those on a GPU). The event loop is the engine's
own: uvloop where it is installed, as ``kvstrata run`` and the server use.

Transports: ``inproc`` runs the engine in this process and streams through
``AsyncEngine.generate`` (each request's text, every consumer's wake-up:
all on the engine's GIL); ``ipc`` runs it in its own process over ZMQ, as
``kvstrata serve`` does by default, and the client's work (text, streams)
is in this process. ``engine_cpu_ms_per_step`` is the CPU time of the
engine's process per step, every thread together;
``engine_loop_thread_cpu_ms_per_step`` that of its event loop's thread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from kvstrata.enginecore.async_engine import AsyncEngine  # noqa: E402
from kvstrata.enginecore.async_engine import run as run_loop  # noqa: E402  (uvloop where installed, as the CLI)
from kvstrata.types import SamplingParams  # noqa: E402
from kvstrata.worker import model_runner, pending_step, sampler  # noqa: E402
from kvstrata.worker.model.default_model import DEFAULT_MODEL_CONFIG, default_model_dir  # noqa: E402
from kvstrata.worker.model.llama import LlamaForCausalLM  # noqa: E402

TINY = {**DEFAULT_MODEL_CONFIG, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
SIM_VOCAB, SIM_TOKEN = 256, 65  # the simulated logits: every row samples token 65 ("b" in the default tokenizer)
MODES = ("serial", "async", "pipelined")
TRANSPORTS = ("inproc", "ipc")
AS_ENGINE = "--as-engine-process"  # argv[1] of this script when it is the ipc transport's engine process


class SimulatedDevice:
    """Owns: when the simulated device finishes what was queued on it, and
    the patches that route the runner's forward and read-backs through it."""

    def __init__(self) -> None:
        self.step_s = 0.0
        self.busy_until = 0.0
        self._done_at: dict[int, float] = {}
        self._saved: list[tuple[object, str, object]] = []

    def install(self) -> None:
        dev = self
        forward_width = TINY["hidden_size"]
        call, init, result = sampler.Sampler.__call__, pending_step.PendingStep.__init__, \
            pending_step.PendingStep.result

        def forward(runner, step):  # queued: returns at once
            dev.busy_until = max(time.perf_counter(), dev.busy_until) + dev.step_s
            return torch.zeros(step.input_ids.shape[0], forward_width)

        def compute_logits(model, hidden):  # device work too: a few columns, so no real matmul or argmax here
            logits = torch.zeros(hidden.shape[0], SIM_VOCAB)
            logits[:, SIM_TOKEN] = 1.0
            return logits

        def sample_then_read(self_, logits, meta):  # the serial path's tolist waits for the device
            dev.wait(dev.busy_until)
            return call(self_, logits, meta)

        def pending_init(self_, *args):
            init(self_, *args)
            dev._done_at[id(self_)] = dev.busy_until

        def pending_result(self_):
            dev.wait(dev._done_at.pop(id(self_), 0.0))
            return result(self_)

        for owner, name, new in ((model_runner.ModelRunner, "_run_forward", forward),
                                 (LlamaForCausalLM, "compute_logits", compute_logits),
                                 (sampler.Sampler, "__call__", sample_then_read),
                                 (pending_step.PendingStep, "__init__", pending_init),
                                 (pending_step.PendingStep, "result", pending_result)):
            self._saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, new)

    def uninstall(self) -> None:
        for owner, name, old in reversed(self._saved):
            setattr(owner, name, old)
        self._saved.clear()

    @staticmethod
    def wait(until: float) -> None:
        left = until - time.perf_counter()
        if left > 0:
            time.sleep(left)


def _cpu_s(stat_path: str) -> float:
    """User + system CPU seconds so far of the process or thread whose /proc stat file this is (Linux)."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:  # a thread that ended
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds so far of process ``pid``: in all, and of its main thread (the event loop)."""
    return _cpu_s(f"/proc/{pid}/stat"), _cpu_s(f"/proc/{pid}/task/{pid}/stat")


async def open_engine(config: EngineConfig, transport: str, step_s: float):
    """The engine in this process (``inproc``, the simulated device installed
    here), or in its own process over ZMQ (``ipc``, as ``kvstrata serve``
    runs it: this script wraps the engine process and installs the
    simulated device there). Returns (engine, pid of the engine's process)."""
    if transport == "inproc":
        return await AsyncEngine.start(config), os.getpid()
    from kvstrata.ipc.mp_client import MPEngineClient

    wrapper = [sys.executable, str(Path(__file__).resolve()), AS_ENGINE, str(step_s * 1e3), "--"]
    client = await MPEngineClient.start(config, transport="ipc", wrapper=wrapper)
    return client, client._proc.pid


async def measure(model_dir: str, batch: int, mode: str, steps: int, transport: str, step_s: float) -> dict:
    """Seconds per decode step of ``batch`` requests generating ``steps`` tokens
    each, and the CPU seconds per step of the engine's process (and of this
    one, the client's, when the engine has its own)."""
    sched = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(512, batch * 40),
                            async_scheduling=mode != "serial", pipelined_steps=mode == "pipelined")
    config = EngineConfig(model=ModelConfig(model=model_dir, num_threads=1), device="cpu", log_level="WARNING",
                          cache=CacheConfig(block_size=16, num_blocks=batch * (steps // 16 + 4) + 16),
                          scheduler=sched)
    engine, pid = await open_engine(config, transport, step_s)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> None:
        async for _ in engine.generate([1 + (i * 7 + j) % 200 for j in range(32)], params, request_id=f"r{i}"):
            pass

    try:
        await asyncio.gather(*(one(i) for i in range(batch)))  # warm-up
        c0, e0, t0 = time.process_time(), _proc_cpu_s(pid), time.perf_counter()
        await asyncio.gather(*(one(batch + i) for i in range(batch)))
        t, e1, c = time.perf_counter() - t0, _proc_cpu_s(pid), time.process_time() - c0
    finally:
        await engine.aclose()
    e, loop_s = e1[0] - e0[0], e1[1] - e0[1]
    row = {"ms_per_step": round(t / steps * 1e3, 3), "engine_cpu_ms_per_step": round(e / steps * 1e3, 3),
           "engine_loop_thread_cpu_ms_per_step": round(loop_s / steps * 1e3, 3)}
    if transport != "inproc":
        row["client_cpu_ms_per_step"] = round(c / steps * 1e3, 3)
    return row


async def run(args: argparse.Namespace) -> dict:
    model_dir = str(default_model_dir(0, config=TINY))
    device = SimulatedDevice()
    device.install()
    rows = []
    try:
        for transport in args.transports:
            for batch in args.batches:
                for device_ms in (1e-3, args.device_ms):
                    device.step_s = device_ms / 1e3
                    row: dict = {"transport": transport, "batch": batch,
                                 "device_ms": device_ms if device_ms >= 0.01 else 0.0}
                    for mode in args.modes:
                        m = await measure(model_dir, batch, mode, args.steps, transport, device.step_s)
                        if device_ms >= 0.01:
                            m["over_device"] = round(m["ms_per_step"] / device_ms, 3)
                        row[mode] = m
                    rows.append(row)
    finally:
        device.uninstall()
    return {"tool": "bench_step_overlap", "command": " ".join(["python", "tools/bench_step_overlap.py", *sys.argv[1:]]),
            "host": {"python": platform.python_version(), "torch": torch.__version__,
                     "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
                     "load_avg": [round(x, 2) for x in os.getloadavg()]},
            "note": "simulated device; the 0.0 ms rows are the host's own cost per step. engine_cpu_ms_per_step: "
                    "CPU time of the engine's process (every thread; inproc: the client's too) per step; "
                    "engine_loop_thread_: of its main thread (the event loop: scheduler, outputs), the rest "
                    "is the step thread's (inputs, launch, read-back) and torch's",
            "rows": rows}


def as_engine(argv: list[str]) -> int:
    """The engine process of the ``ipc`` transport: ``AS_ENGINE STEP_MS -- python -m
    kvstrata.ipc.engine_proc ARGS``: the simulated device, then the engine process's main."""
    step_ms, sep, python, flag, module, *rest = argv
    if sep != "--" or flag != "-m" or module != "kvstrata.ipc.engine_proc":
        raise SystemExit(f"{AS_ENGINE}: expected STEP_MS -- python -m kvstrata.ipc.engine_proc ARGS, got {argv}")
    from kvstrata.ipc import engine_proc

    device = SimulatedDevice()
    device.step_s = float(step_ms) / 1e3
    device.install()
    return engine_proc.main(rest)


def main() -> None:
    if sys.argv[1:2] == [AS_ENGINE]:
        sys.exit(as_engine(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,64", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--device-ms", type=float, default=3.0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--modes", default=",".join(MODES), type=lambda s: s.split(","),
                   help="which of serial,async,pipelined to run (default: all)")
    p.add_argument("--transports", default="inproc", type=lambda s: s.split(","),
                   help="inproc (the engine in this process, as AsyncEngine.generate) and/or ipc (the engine "
                        "in its own process over ZMQ, as `kvstrata serve` runs it); default: inproc")
    p.add_argument("--quick", action="store_true", help="2 and 8 requests, 24 steps (seconds; the test)")
    args = p.parse_args()
    from kvstrata.logs import configure_logging

    configure_logging("WARNING", json=False)  # logs on stderr; stdout is the JSON report
    if unknown := [m for m in args.modes if m not in MODES]:
        p.error(f"--modes: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if unknown := [t for t in args.transports if t not in TRANSPORTS]:
        p.error(f"--transports: unknown transport(s) {', '.join(unknown)}; choose from {', '.join(TRANSPORTS)}")
    if args.quick:
        args.batches, args.steps = [2, 8], 24
    print(json.dumps(run_loop(run(args)), indent=1))


if __name__ == "__main__":
    main()
