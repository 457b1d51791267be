"""How much of the host's work per step hides behind the device's: the
engine's real host work (scheduler, input batch, sampler, outputs, the
event loop, the step thread) against a simulated device. Prints JSON.

    python tools/bench_step_overlap.py [--quick] [--batches 1,64] [--device-ms 3]
                                       [--steps 200]

The model's forward is replaced by a simulated device queue: a launch
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
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

TINY = {**DEFAULT_MODEL_CONFIG, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
MODES = ("serial", "async", "pipelined")


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


async def measure(model_dir: str, batch: int, mode: str, steps: int) -> float:
    """Seconds per decode step of ``batch`` requests generating ``steps`` tokens each."""
    sched = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(512, batch * 40),
                            async_scheduling=mode != "serial", pipelined_steps=mode == "pipelined")
    config = EngineConfig(model=ModelConfig(model=model_dir, num_threads=1), device="cpu", log_level="WARNING",
                          cache=CacheConfig(block_size=16, num_blocks=batch * (steps // 16 + 4) + 16),
                          scheduler=sched)
    engine = await AsyncEngine.start(config)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> None:
        async for _ in engine.generate([1 + (i * 7 + j) % 200 for j in range(32)], params, request_id=f"r{i}"):
            pass

    try:
        await asyncio.gather(*(one(i) for i in range(batch)))  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(one(batch + i) for i in range(batch)))
        return (time.perf_counter() - t0) / steps
    finally:
        await engine.aclose()


async def run(args: argparse.Namespace) -> dict:
    model_dir = str(default_model_dir(0, config=TINY))
    device = SimulatedDevice()
    device.install()
    rows = []
    try:
        for batch in args.batches:
            for device_ms in (1e-3, args.device_ms):
                device.step_s = device_ms / 1e3
                row: dict = {"batch": batch, "device_ms": device_ms if device_ms >= 0.01 else 0.0}
                for mode in MODES:
                    s = await measure(model_dir, batch, mode, args.steps)
                    row[mode] = {"ms_per_step": round(s * 1e3, 3),
                                 **({"over_device": round(s * 1e3 / device_ms, 3)} if device_ms >= 0.01 else {})}
                rows.append(row)
    finally:
        device.uninstall()
    return {"tool": "bench_step_overlap", "command": " ".join(["python", "tools/bench_step_overlap.py", *sys.argv[1:]]),
            "host": {"python": platform.python_version(), "torch": torch.__version__,
                     "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
                     "load_avg": [round(x, 2) for x in __import__("os").getloadavg()]},
            "note": "simulated device; the 0.0 ms rows are the host's own cost per step", "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,64", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--device-ms", type=float, default=3.0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="2 and 8 requests, 24 steps (seconds; the test)")
    args = p.parse_args()
    from kvstrata.logs import configure_logging

    configure_logging("WARNING", json=False)  # logs on stderr; stdout is the JSON report
    if args.quick:
        args.batches, args.steps = [2, 8], 24
    print(json.dumps(run_loop(run(args)), indent=1))


if __name__ == "__main__":
    main()
