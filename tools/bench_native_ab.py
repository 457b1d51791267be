"""A/B two builds of the native packed-matmul kernel (``kvstrata/kernels/csrc/lowbit_bf16.c``)
in one process; prints one JSON object.

The baseline is the source at a git revision (``--base``, default HEAD), the
other the working tree's. Both are built as the loader builds them
(``native_build.build``: same compiler and flags, cached by content) and
called through the same bound weights: SmolLM2's 30 layers' qkv, o,
gate_up and down (the packed GGUF; with ``--qtype``, random blocks of that
type in those shapes, as ``bench_quant.py`` makes them, for ``--layers``
layers, no GGUF needed; 1 thread), for each ``--tokens`` count. Rounds run the builds in a random order each time; the
figure is the median ms per pass over the 120 matmuls. ``bit_equal``: both
builds wrote the same bits for every output (the kernel's contract: a change
of speed only).

Usage: python tools/bench_native_ab.py [--base REV] [--tokens 1,4,5,8,16,64] [--dtype float32|bfloat16]
                                       [--qtype Q4_0|Q4_1|Q5_0|Q5_1|Q4_K|Q5_K|Q6_K|Q8_0 [--layers N]]
Never asserts timings. Needs the SmolLM2 GGUF (``kvstrata run`` fetches it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvstrata.logs import configure_logging

ROOT = Path(__file__).resolve().parent.parent
REL = "kvstrata/kernels/csrc/lowbit_bf16.c"
# SmolLM2-135M's linear layers, (out_features, in_features): qkv, o, gate_up, down
SMOLLM2_LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def one_pass(calls: list, sums: torch.Tensor) -> None:
    for bound, x, out in calls:
        bound(x, out, sums)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the baseline source (default HEAD)")
    ap.add_argument("--tokens", default="1,4,5,8,16,64", help="rows of x, comma-separated")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="x's dtype")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--qtype", default=None, help="random weights of this type (default: the GGUF's own)")
    ap.add_argument("--layers", type=int, default=30, help="--qtype: layers of SmolLM2's shapes (default 30)")
    args = ap.parse_args()
    configure_logging("WARNING", json=False)
    from kvstrata.config import EngineConfig, ModelConfig
    from kvstrata.enginecore.builder import build_runner
    from kvstrata.kernels import native_build, quant_cpu
    from kvstrata.worker.model.smollm2 import locate_smollm2

    torch.set_num_threads(1)
    nk = quant_cpu.native_kernels()
    if nk is None:
        raise SystemExit(f"no native kernels here: {quant_cpu.native_status()}")
    with tempfile.TemporaryDirectory() as tmp:
        base_src = Path(tmp) / "lowbit_bf16.c"
        shown = subprocess.run(["git", "show", f"{args.base}:{REL}"], cwd=ROOT, capture_output=True)
        if shown.returncode != 0:
            raise SystemExit(f"git show {args.base}:{REL} failed: {shown.stderr.decode(errors='replace').strip()}")
        base_src.write_bytes(shown.stdout)
        fns = {}
        for name, src in (("base", base_src), ("tree", ROOT / REL)):
            fn = ctypes.CDLL(str(native_build.build(src, Path(tmp) / "so"))).kvq_matmul
            fn.restype, fn.argtypes = ctypes.c_int, nk._fn.argtypes
            fns[name] = fn
        if args.qtype is None:
            cfg = EngineConfig(model=ModelConfig(model=str(locate_smollm2()), num_threads=1, dtype=args.dtype),
                               device="cpu", log_level="WARNING")
            linears = [lin for layer in build_runner(cfg).model.model.layers
                       for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                   layer.mlp.down_proj)]
            weights = [(lin.parts[0].qtype.name, lin.parts[0].planes[0], lin.out_features, lin.in_features)
                       for lin in linears]
        else:
            sys.path.insert(0, str(ROOT / "tools"))
            from bench_quant import QUANT_TYPES, random_packed
            from kvstrata.kernels import with_cpu_path
            block = QUANT_TYPES[args.qtype].block  # K-quants: in_features rounded up to their 256
            weights = []
            for i, (n, k) in enumerate(SMOLLM2_LAYER * args.layers):
                k = -(-k // block) * block
                packed = random_packed(args.qtype, n, k, seed=i)
                weights.append((args.qtype, with_cpu_path(packed, "native", keep_blocks=False).planes[0], n, k))
        bound = [(nk.bind(qtype, planes), k, n) for qtype, planes, n, k in weights]
        dtype = getattr(torch, args.dtype)
        rows = []
        for m in (int(t) for t in args.tokens.split(",")):
            gen = torch.Generator().manual_seed(m)
            calls = [(b, torch.randn(m, k, generator=gen).to(dtype), torch.empty(m, n)) for b, k, n in bound]
            sums = torch.empty(m * max(k for _, k, _ in bound) // 32)
            times: dict[str, list[float]] = {name: [] for name in fns}
            outs = {}
            reps = max(3, 200 // m)
            for _ in range(args.rounds):
                for name in random.sample(list(fns), len(fns)):
                    for b, _, _ in calls:
                        b._fn = fns[name]
                    one_pass(calls, sums)  # warm-up
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        one_pass(calls, sums)
                    times[name].append((time.perf_counter() - t0) / reps * 1e3)
                    outs[name] = torch.cat([out.flatten() for _, _, out in calls])
            med = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
            rows.append({"tokens": m, "base_ms": round(med["base"], 3), "tree_ms": round(med["tree"], 3),
                         "speedup": round(med["base"] / med["tree"], 3),
                         "bit_equal": torch.equal(outs["base"], outs["tree"])})
    print(json.dumps({"base": args.base, "dtype": args.dtype, "qtype": args.qtype or "the GGUF's", "threads": 1, "machine": platform.processor()
                      or platform.machine(), "isa": nk.isa, "matmuls_per_pass": len(bound), "results": rows},
                     indent=1))


if __name__ == "__main__":
    main()
