"""Instructions per weight of the quantized decode GEMVs, compiled for sm_90
on any host (triton's CUDA backend, its bundled ptxas and nvdisasm; no GPU);
prints one JSON object.

A decode GEMV over 4.5-bit weights is fast only while the SMs issue its
instructions faster than HBM delivers the bytes: on an H200 (132 SMs, 4
warp-instructions per clock each, ~1.8 GHz, 4.8 TB/s) a Q4_0 weight arrives
every ~0.9 ps, and ~7 instructions per weight already take ~2 ps. So the
figure that decides whether a kernel can reach the bandwidth is the SASS
instruction count of its K loop per weight it handles, counted here for

  general    _triton_quant's GEMV tiles (byte loads, I2F, a cross-thread sum every step)
  gemv       what quant_matmul runs: _triton_quant_gemv's few-token kernel at 1-2
             tokens (one layout, scale per word), its multi-token kernel at more
  gemv_many  (1-2 tokens only) the multi-token kernel there: what the few-token
             kernel replaced
  layout     (Q8_0, Q4_0, Q4_K, Q6_K, up to 8 tokens) _triton_quant_gpu_layout's GEMV
             over the GPU layout (model.gpu_quant_layout): its K loop's global loads
             by width (``load_widths``: LDG.E.128 is a 16-byte load of 4 words)

per format and token count: the loop's instructions per K step (the largest
backward branch's body over the K steps one pass makes, where ptxas unrolled
it (steps_per_loop_body); where ptxas unrolled the whole loop, all
instructions over the trip count), weights one thread handles per step,
their ratio, and the loop's global loads, shuffles, barriers and
local-memory accesses (spills) per pass. This is a static proxy, not a
timing: memory latency, occupancy and the issue of other warps are not in
it; tools/bench_quant.py on a GPU times the same kernels.

Usage: python tools/quant_gemv_sass.py [--types Q4_0,Q4_K] [--tokens 1,2,4,8] [--n 4096] [--k 4096] [--dtype bf16]
       python tools/quant_gemv_sass.py --layout-only [--types Q4_0] ...   (the layout GEMV alone)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvstrata.kernels import _triton_quant as general  # noqa: E402
from kvstrata.kernels import _triton_quant_gemv as gemv  # noqa: E402
from kvstrata.kernels import _triton_quant_gemv_few as gemv_few  # noqa: E402
from kvstrata.kernels import _triton_quant_gpu_layout as layout  # noqa: E402
from kvstrata.kernels.quant_gpu_layout import LAYOUT_FIELDS  # noqa: E402
from kvstrata.kernels.quant import quant_type  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_DOT = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
_TYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


_PTR = {torch_name: f"*{short}" for torch_name, short in
        (("int32", "i32"), ("int16", "i16"), ("int8", "i8"), ("uint8", "u8"), ("float16", "fp16"))}


def _compile(raw, dtype: str, consts: dict, launch: dict, pointers: dict[str, str] | None = None):
    fn = triton.jit(raw)
    types = dict(x_ptr=_TYPES[dtype], w_ptr="*u8", bias_ptr=_TYPES[dtype], out_ptr=_TYPES[dtype], num_tokens="i32",
                 x_stride="i32", out_stride="i32", one="i32", **(pointers or {}))
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    constexprs = {(fn.arg_names.index(name),): value for name, value in consts.items()}
    # what the launcher marks on real tensors: 16-byte aligned pointers, and x's row stride (K:
    # a multiple of every format's block, so of 16)
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in ("x_ptr", "w_ptr", "out_ptr", "x_stride", *(pointers or {})) if name in fn.arg_names}
    try:
        source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    except TypeError as e:  # triton < 3.3 spells this API differently
        raise NotImplementedError(f"triton {triton.__version__}'s ASTSource takes no constexprs: {e}") from e
    kernel = triton.compile(source, target=TARGET, options={**launch, **general._LAUNCH_OPTIONS})
    kernel.tiles = consts
    kernel.num_warps = launch.get("num_warps", 4)
    return kernel


def compile_gemv(qtype: str, tokens: int, n: int, k: int, dtype: str, many: bool = False):
    """The kernel ``quant_gemv_triton`` runs for ``tokens`` (1-2: _gemv_few_kernel, more:
    _gemv_kernel; ``many``: _gemv_kernel for any count) with the tiles it picks."""
    few = not many and tokens <= gemv.FEW_MAX_TOKENS
    t = gemv.gemv_few_tiles(tokens, n, k, qtype) if few else gemv.gemv_tiles(tokens, n, k, qtype)
    launch = {key: t.pop(key) for key in ("num_warps", "num_stages") if key in t}
    ch, u, h, w = (gemv.FEW_GEOMETRY if few else gemv.GEOMETRY)[qtype]
    consts = dict(N=n, K=k, QT=general.QT_CODES[qtype], TS=quant_type(qtype).type_size, HAS_BIAS=False, CH=ch, U=u,
                  H=h, W=w, K_SCALE=triton.jit(gemv._k_scale), FIFTH=triton.jit(gemv._fifth),
                  Q6_SCALES=triton.jit(gemv._q6_scales), **t)
    if few:
        consts["C_LAST"] = gemv.C_LAST
        return _compile(gemv_few._gemv_few_kernel, dtype, consts, launch)
    consts.update(VALUE=triton.jit(gemv._value), Q6_VALUE=triton.jit(gemv._q6_value))
    return _compile(gemv._gemv_kernel, dtype, consts, launch)


def compile_layout(qtype: str, tokens: int, n: int, k: int, dtype: str):
    """_triton_quant_gpu_layout's GEMV with the tiles ``layout_gemv_tiles`` picks; its
    ``tiles`` say BLOCK_K (NV vectors of weights) as the other kernels' do."""
    t = layout.layout_gemv_tiles(tokens, n, k, qtype)
    launch = {"num_warps": t.pop("num_warps")}
    names = ("q_ptr", "f1_ptr", "f2_ptr", "f3_ptr", "f4_ptr")
    fields = [_PTR[str(dt).removeprefix("torch.")] for _, dt, _ in LAYOUT_FIELDS[qtype]]
    pointers = dict(zip(names, fields + [fields[0]] * (len(names) - len(fields))))
    consts = dict(N=n, K=k, QT=general.QT_CODES[qtype], HAS_BIAS=False, **t)
    kernel = _compile(layout._layout_gemv_kernel, dtype, consts, launch, pointers)
    kernel.tiles = dict(K=k, BLOCK_T=t["BLOCK_T"], BLOCK_N=t["BLOCK_N"], BLOCK_K=t["NV"] * layout.VECTOR_WEIGHTS[qtype])
    return kernel


def compile_general(qtype: str, tokens: int, n: int, k: int, dtype: str):
    """_triton_quant's kernel with the tiles ``tiles`` picks on CUDA."""
    t = general.tiles(tokens, n, k, interpreted=False)
    launch = {key: t.pop(key) for key in ("num_warps", "num_stages") if key in t}
    qt = quant_type(qtype)
    consts = dict(N=n, K=k, QT=general.QT_CODES[qtype], QK=qt.block, TS=qt.type_size, DOT_DT=_DOT[dtype],
                  HAS_BIAS=False, F16=triton.jit(general._f16), DEQUANT=triton.jit(general._dequant_tile), **t)
    return _compile(general._quant_matmul_kernel, dtype, consts, launch)


_SASS: dict[bytes, str] = {}  # cubin -> its SASS: nvdisasm takes ~0.6 s a kernel, and callers ask again


def sass(kernel) -> str:
    cubin = kernel.asm["cubin"]
    text = _SASS.get(cubin)
    if text is None:
        nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            text = subprocess.run([str(nvdisasm), "-c", path], check=True, capture_output=True, text=True).stdout
        _SASS[cubin] = text
    return text


_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def _unroll(loop: list[str], block_k: int) -> int:
    """K steps one pass of the loop body makes (ptxas may unroll the K loop): the
    counter the loop's exit test compares, stepped by a multiple of BLOCK_K."""
    tested = set()
    for op in loop:
        m = re.match(r"U?ISETP\S*\s+\S+,\s+\S+,\s+(U?R\d+),\s+0x[0-9a-f]+", op)
        if m:
            tested.add(m.group(1))
    for op in loop:
        m = re.match(r"U?IADD3\s+(U?R\d+),\s+U?P\d+,\s+(U?R\d+),\s+0x([0-9a-f]+)", op)
        if m and m.group(1) == m.group(2) and m.group(1) in tested:
            inc = int(m.group(3), 16)
            if inc % block_k == 0:
                return inc // block_k
    return 1


def count(kernel) -> dict:
    """The K loop's instruction counts (see the module docstring)."""
    text = sass(kernel)
    labels, insns, pending = {}, [], []
    for line in text.splitlines():
        m = re.match(r"\s*\.?(L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSN.search(line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            insns.append((addr, m.group(2)))
    body = None
    for addr, op in insns:
        m = re.search(r"\bBRA\b.*\(\.?(L_x_\d+)\)", op)
        if m and m.group(1) in labels and labels[m.group(1)] < addr:
            start = labels[m.group(1)]
            if body is None or addr - start > body[1] - body[0]:
                body = (start, addr)
    t = kernel.tiles
    steps = t["K"] // t["BLOCK_K"]
    unroll = 1
    if body is not None:
        loop = [op for addr, op in insns if body[0] <= addr <= body[1]]
        unroll = _unroll(loop, t["BLOCK_K"])
        per_step = len(loop) / unroll
    else:  # unrolled: every instruction, spread over the trip count
        loop = [op for _, op in insns]
        per_step = round(len(loop) / steps)
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", op).split()[0].split(".")[0] for op in loop)
    widths = Counter(m.group(1) for op in loop for m in [re.match(r"(?:@!?U?P\w+\s+)?(LDG\S*)", op)] if m)
    threads = 32 * kernel.num_warps
    return {
        "k_loop": round(per_step, 2),
        "unrolled": body is None,
        "steps_per_loop_body": unroll,
        "weights_per_thread_step": t["BLOCK_N"] * t["BLOCK_K"] // threads,
        "tokens_per_program": t["BLOCK_T"],
        "global_loads": ops["LDG"],
        "load_widths": dict(sorted(widths.items())),
        "shuffles": ops["SHFL"],
        "barriers": ops["BAR"],
        "local_memory": sum(op.split()[0].startswith(("LDL", "STL")) for _, op in insns),
        "tiles": {key: t[key] for key in ("BLOCK_T", "BLOCK_N", "BLOCK_K")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(gemv.GEMV_TYPES))
    parser.add_argument("--tokens", default="1,2,4,8")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--dtype", default="bf16", choices=sorted(_DOT))
    parser.add_argument("--layout-only", action="store_true", help="only the GPU layout's GEMV")
    args = parser.parse_args()
    cases = []
    for qtype in args.types.split(","):
        for tokens in map(int, args.tokens.split(",")):
            cases.append(_case(qtype, tokens, args))
    print(json.dumps({"triton": triton.__version__, "target": "sm_90", "shape": [args.n, args.k],
                      "dtype": args.dtype, "cases": cases}, indent=1))


def _case(qtype: str, tokens: int, args) -> dict:
    """One format and token count: each kernel's counts, and their ratios."""
    row = {"qtype": qtype, "tokens": tokens}
    builds = [] if args.layout_only else [("general", compile_general), ("gemv", compile_gemv)]
    if tokens <= gemv.FEW_MAX_TOKENS and not args.layout_only:  # the multi-token GEMV: what _gemv_few_kernel replaced
        builds.append(("gemv_many", lambda *a: compile_gemv(*a, many=True)))
    if qtype in LAYOUT_FIELDS and tokens <= layout.LAYOUT_GEMV_MAX_TOKENS:
        builds.append(("layout", compile_layout))
    for name, build in builds:
        c = count(build(qtype, tokens, args.n, args.k, args.dtype))
        c["per_weight"] = round(c["k_loop"] / c["weights_per_thread_step"], 2)
        row[name] = c
    if "gemv" in row:
        row["instructions_general_over_gemv"] = round(row["general"]["per_weight"] / row["gemv"]["per_weight"], 2)
        if "layout" in row:
            row["instructions_gemv_over_layout"] = round(row["gemv"]["per_weight"] / row["layout"]["per_weight"], 2)
    if "gemv_many" in row:
        row["instructions_many_over_few"] = round(row["gemv_many"]["per_weight"] / row["gemv"]["per_weight"], 2)
    return row



if __name__ == "__main__":
    main()
