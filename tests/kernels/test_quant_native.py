"""The "native" CPU path: our kernels (kernels/csrc/lowbit_bf16.c via
kernels/quant_native.py) on the blocks re-laid (kernels/quant_relayout.py).

Every packed type against ``dequantize`` in float64 for a bf16 x and a
float32 x (used as given: no rounding of x), 1-17 rows (registers and
tiles), the AVX2 kernel bit-equal to the AVX512 one for a float32 x, a column slice of a wider output, bias and bf16 out; a float32 x
through an identity-like weight comes back bit-equal; rows read back
bit-equal to ``dequantize``; resident bytes the file's; a row's bits
independent of its batch and of the thread count; argument errors; its
place among the CPU paths; the build cache and the off switch.

Runs where the kernels build and run (a C compiler with OpenMP, an x86-64
CPU with AVX2 + FMA + F16C; the AVX512 comparisons where it has AVX512_BF16,
as the CI host does); elsewhere those tests skip, naming why,
and the build errors are still tested."""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.kernels import (KernelArgumentError, choose_cpu_path, dequantize, pack_weight, quant_matmul,
                              with_cpu_path)
from kvstrata.kernels.quant_cpu import planes_rows
from kvstrata.kernels.native_build import NativeUnavailable, build
from kvstrata.kernels import quant_native
from kvstrata.kernels.quant_native import LAYOUTS, SOURCE, NativeKernels, matmul_threads, native_kernels, native_status
from kvstrata.kernels.quant_relayout import native_planes, native_rows

pytest.importorskip("gguf")
from kernel_builders import run_python  # noqa: E402
from test_quant_kernels import random_packed  # noqa: E402

native = pytest.mark.skipif(native_kernels() is None, reason=f"no native kernels here: {native_status()}")
TYPES = list(LAYOUTS)  # Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K Q8_0


def cols_for(qtype: str, blocks: int = 2) -> int:
    return blocks * (256 if qtype.endswith("_K") else 32)


def exact(x: torch.Tensor, packed) -> torch.Tensor:
    """x as given @ the dequantized weight, float64."""
    return x.double() @ dequantize(packed).double().T


def term_scale(x: torch.Tensor, packed) -> torch.Tensor:
    return x.double().abs() @ dequantize(packed).double().abs().T


# a float32 accumulation of exact products: F.linear on the dequantized float32 weight measures
# 3e-8 - 1e-7 of S on these shapes; x rounded to bf16 anywhere would be ~1e-3
TOL = 1e-6
X_DTYPES = [torch.bfloat16, torch.float32]


def test_every_packed_type_has_a_layout():
    assert TYPES == ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0"]


@native
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [64, 320])
# registers: 1-4 rows, or where the kind and x allow (matmul's ``direct``) chunks of 4-6 (5, 8: 4 + 4,
# 13: 6 + 4 + 3, 17: 6 + 6 + 5); from a tile, the same chunks, otherwise
@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 8, 13, 17])
def test_native_matches_dequantize_in_float64(qtype, rows, tokens, x_dtype):
    packed = random_packed(qtype, rows, cols_for(qtype), seed=tokens)
    w = with_cpu_path(packed, "native")
    x = torch.randn(tokens, packed.in_features, generator=torch.Generator().manual_seed(rows + tokens)).to(x_dtype)
    acc = torch.full((tokens, rows), float("nan"))  # every entry must be written
    native_kernels().matmul(qtype, x, w.planes[0], acc)
    assert ((acc.double() - exact(x, packed)).abs() <= TOL * term_scale(x, packed) + 1e-30).all()


def two_eye_blocks(qtype: str, n: int) -> torch.Tensor:
    """The GGUF blocks of W = 2 I [n, n], written by hand: d = 1 (m = 0), q
    (less Q4_0's 8) 2 on the diagonal, 0 elsewhere."""
    one = np.float16(1.0).tobytes()
    rows = []
    for r in range(n):
        row = b""
        for b in range(n // 32):
            q = [2 if 32 * b + j == r else 0 for j in range(32)]
            if qtype == "Q8_0":
                row += one + bytes(v & 0xFF for v in q)
            else:
                q = [v + 8 for v in q] if qtype == "Q4_0" else q
                nib = bytes(q[i] | q[i + 16] << 4 for i in range(16))
                row += one + (np.float16(0.0).tobytes() if qtype == "Q4_1" else b"") + nib
        rows.append(np.frombuffer(row, dtype=np.uint8))
    return torch.from_numpy(np.stack(rows))


@native
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("tokens", [1, 6])
def test_a_float32_x_is_used_as_given(qtype, tokens):
    """W = 2 I: out = 2 x exactly for a float32 x (one rounding-free FMA per
    row: no bf16 anywhere), 2 bf16(x) for a bf16 x."""
    n = k = 128
    packed = pack_weight(two_eye_blocks(qtype, n), qtype, (n, k))
    assert torch.equal(dequantize(packed), 2 * torch.eye(n, k))
    w = with_cpu_path(packed, "native")
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1)) * 1e-3
    out = torch.empty(tokens, n)
    native_kernels().matmul(qtype, x, w.planes[0], out)
    assert torch.equal(out, 2 * x)
    native_kernels().matmul(qtype, x.to(torch.bfloat16), w.planes[0], out)
    assert torch.equal(out, 2 * x.to(torch.bfloat16).float()) and not torch.equal(out, 2 * x)


def avx2_kernels() -> NativeKernels:
    """The loaded library again, running its AVX2 kernel (any CPU that runs the native kernels runs it)."""
    k = native_kernels()
    return NativeKernels(ctypes.CDLL(str(k.path)), k.path, "avx2")


@native
@pytest.mark.parametrize("qtype", TYPES)
# whole blocks a pass per row (1-5 rows of the Q4 kinds), registers (1-2), tiles of 3 and a rest
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 17])
def test_the_avx2_kernel_is_bit_equal_to_the_avx512_one_for_a_float32_x(qtype, tokens):
    """The AVX2 kernel (CPUs without AVX512_BF16) does the float32 kernel's
    arithmetic term for term on half the width: the same bits, and
    within TOL of dequantize in float64; a bf16 x is widened (exact)."""
    rows = 192
    packed = random_packed(qtype, rows, cols_for(qtype), seed=tokens + 20)
    w = with_cpu_path(packed, "native")
    x = torch.randn(tokens, packed.in_features, generator=torch.Generator().manual_seed(tokens))
    two = torch.full((tokens, rows), float("nan"))
    avx2_kernels().matmul(qtype, x, w.planes[0], two)
    assert ((two.double() - exact(x, packed)).abs() <= TOL * term_scale(x, packed) + 1e-30).all()
    if native_kernels().isa == "avx512_bf16":
        wide = torch.full((tokens, rows), float("nan"))
        native_kernels().matmul(qtype, x, w.planes[0], wide)
        assert torch.equal(two, wide)
    xb = x.to(torch.bfloat16)
    from_bf16, from_f32 = torch.empty(tokens, rows), torch.empty(tokens, rows)
    avx2_kernels().matmul(qtype, xb, w.planes[0], from_bf16)
    avx2_kernels().matmul(qtype, xb.float(), w.planes[0], from_f32)
    assert torch.equal(from_bf16, from_f32)


def test_an_unknown_isa_is_refused():
    with pytest.raises(KernelArgumentError, match="isa must be one of avx512_bf16, avx2, got 'sse2'"):
        NativeKernels(None, Path("x.so"), "sse2")


@native
@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_K", "Q8_0"])
def test_native_through_quant_matmul_with_bias_slices_and_bf16(qtype):
    packed = random_packed(qtype, 128, cols_for(qtype), seed=4)
    k = packed.in_features
    w = with_cpu_path(packed, "native", keep_blocks=False)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(128, generator=torch.Generator().manual_seed(6))
    wide = torch.full((6, 320), 3.0)
    quant_matmul(x, w, bias, out=wide[:, 64:192])
    got = wide[:, 64:192].double()
    assert ((got - exact(x, packed) - bias.double()).abs() <= TOL * term_scale(x, packed) + 1e-6).all()
    assert torch.equal(wide[:, :64], torch.full((6, 64), 3.0)) and torch.equal(wide[:, 192:], torch.full((6, 128), 3.0))
    low = quant_matmul(x.to(torch.bfloat16), w)
    assert low.dtype == torch.bfloat16
    assert ((low.double() - exact(x, packed)).abs() <= 2.0**-8 * term_scale(x, packed) + 1e-6).all()


@native
@pytest.mark.parametrize("qtype", TYPES)
def test_rows_read_back_are_bit_equal_and_bytes_are_the_files(qtype):
    packed = random_packed(qtype, 192, cols_for(qtype, 3), seed=7)
    w = with_cpu_path(packed, "native", keep_blocks=False)
    assert w.data is None and w.cpu_path == "native"
    extra = 1.03 if qtype.endswith("_K") and qtype != "Q6_K" else 1.0  # the K-quants' 6-bit scales as bytes
    assert packed.nbytes <= w.nbytes <= extra * packed.nbytes
    ids = torch.tensor([0, 1, 7, 8, 15, 16, 31, 32, 47, 48, 63, 64, 100, 191, 5, 5])
    assert torch.equal(native_rows(w, ids, torch.float32), dequantize(packed)[ids])
    assert torch.equal(planes_rows(w, ids, torch.bfloat16), dequantize(packed)[ids].to(torch.bfloat16))


@native
@pytest.mark.parametrize("isa", ["default", "avx2"])
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_1", "Q4_K", "Q6_K", "Q8_0"])
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_threads(qtype, x_dtype, isa, monkeypatch):
    """A row alone (registers) and in a batch of 7 or 19 (chunks of 4-6 rows
    in registers or from a tile; AVX2: of 2-3) gives the same bits;
    so do one and two threads (the blocks of 64 rows, AVX2 halves of 32,
    split over threads, each summed alike)."""
    monkeypatch.setattr(quant_native, "_THREADS_SLEEP", False)  # two threads even for this small a matmul
    kernels = avx2_kernels() if isa == "avx2" else native_kernels()
    w = with_cpu_path(random_packed(qtype, 192, cols_for(qtype)), "native")
    k = w.in_features
    xb = torch.randn(19, k, generator=torch.Generator().manual_seed(3)).to(x_dtype)
    batch = torch.empty(19, 192)
    kernels.matmul(qtype, xb, w.planes[0], batch)
    for lo, hi in ((0, 1), (1, 3), (4, 7), (6, 7), (0, 7), (7, 19), (12, 18)):
        part = torch.empty(hi - lo, 192)
        kernels.matmul(qtype, xb[lo:hi].contiguous(), w.planes[0], part)
        assert torch.equal(part, batch[lo:hi]), (lo, hi)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = torch.empty(19, 192)
        kernels.matmul(qtype, xb, w.planes[0], two)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(two, batch)


def test_small_matmuls_run_on_the_calling_thread_where_threads_sleep(monkeypatch):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for sleeping, small, large in ((True, 1, 2), (False, 2, 2)):
            monkeypatch.setattr(quant_native, "_THREADS_SLEEP", sleeping)
            assert matmul_threads(quant_native.SERIAL_MACS - 1) == small
            assert matmul_threads(quant_native.SERIAL_MACS) == large
        torch.set_num_threads(1)
        assert matmul_threads(1 << 40) == 1
    finally:
        torch.set_num_threads(threads)


@native
@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "Q8_0"])
def test_native_is_the_path_wherever_it_runs_at_every_dtype(qtype):
    """Exact at every dtype, so no race: "native" for float32 and bf16
    activations alike, untimed on request; a float32 choice's matmul is
    float32-exact (x not rounded)."""
    packed = random_packed(qtype, 256, cols_for(qtype), seed=8)
    for dtype in (torch.float32, torch.bfloat16):
        timed = choose_cpu_path(packed, (1, 16), dtype=dtype, reps=1, ring_bytes=0)
        assert timed.path == "native" and set(timed.times_ms) == {"native", "dense"}
        assert set(timed.times_ms["native"]) == {1, 16}
        assert timed.weight.cpu_path == "native" and timed.weight.planes is not None
    untimed = choose_cpu_path(packed, (1,), reps=1, ring_bytes=0, measure=False)
    assert untimed.path == "native" and untimed.times_ms == {}
    x = torch.randn(3, packed.in_features, generator=torch.Generator().manual_seed(9))
    got = quant_matmul(x, untimed.weight)
    assert ((got.double() - exact(x, packed)).abs() <= TOL * term_scale(x, packed)).all()


@native
@pytest.mark.parametrize("case", ["qtype", "k", "count", "shape", "dtype", "strided", "x_dtype", "acc_rows", "acc_cols"])
def test_matmul_argument_errors_name_what_is_wrong(case):
    w = with_cpu_path(random_packed("Q4_1", 64, 64), "native")
    lo, d, m = w.planes[0]
    xb, acc = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 64)
    args, match = {
        "qtype": (("Q3_K", xb, w.planes[0], acc), "take Q4_0"),
        "k": (("Q4_1", torch.zeros(2, 48, dtype=torch.bfloat16), w.planes[0], acc), "K % 32"),
        "count": (("Q4_1", xb, (lo, d), acc), "planes for Q4_1 must be \\(lo, d, m\\)"),
        "shape": (("Q4_1", xb, (lo[:, :32], d, m), acc), "planes lo must be contiguous uint8 \\[1, 64, 32\\]"),
        "dtype": (("Q4_1", xb, (lo, d.float(), m), acc), "planes d must be contiguous float16"),
        "strided": (("Q4_1", xb, (lo, torch.zeros(64, 2, dtype=torch.float16).T, m), acc), "planes d must be"),
        "x_dtype": (("Q4_1", xb.half(), w.planes[0], acc), "x must be a contiguous 2-D bfloat16 or float32"),
        "acc_rows": (("Q4_1", xb, w.planes[0], torch.zeros(3, 64)), "acc must be float32 \\[2, N\\]"),
        "acc_cols": (("Q4_1", xb, w.planes[0], torch.zeros(2, 128)[:, ::2]), "contiguous rows"),
    }[case]
    with pytest.raises(KernelArgumentError, match=match):
        native_kernels().matmul(*args)


def test_the_native_path_needs_a_packed_type_and_whole_row_blocks():
    if native_kernels() is None:
        with pytest.raises(KernelArgumentError, match="native kernels"):
            with_cpu_path(random_packed("Q4_0", 64, 64), "native")
        return
    with pytest.raises(KernelArgumentError, match="out_features % 64 == 0"):
        with_cpu_path(random_packed("Q4_0", 80, 64), "native")  # 80 rows: int4 yes (% 16), native no
    with pytest.raises(KernelArgumentError, match="no native layout"):
        native_planes(random_packed("Q4_0", 80, 64))
    with pytest.raises(KernelArgumentError, match="no native planes"):
        native_rows(with_cpu_path(random_packed("Q4_0", 64, 64), "int4"), torch.tensor([0]), torch.float32)


@pytest.mark.skipif(shutil.which("cc") is None and not os.environ.get("CC"), reason="no C compiler")
def test_build_is_cached_by_source_and_rebuilt_when_it_changes(tmp_path):
    src = tmp_path / "k.c"
    src.write_text("int kvq_abi_version(void) { return 1; }\n")
    first = build(src, tmp_path / "out")
    mtime = first.stat().st_mtime_ns
    assert build(src, tmp_path / "out") == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    src.write_text("int kvq_abi_version(void) { return 2; }\n")
    second = build(src, tmp_path / "out")
    assert second != first and second.is_file() and first.is_file()  # the old build stays
    assert [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".")] == []  # no temp files left


def test_build_errors_name_the_compiler_and_the_failure(tmp_path, monkeypatch):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    if shutil.which("cc") or os.environ.get("CC"):
        with pytest.raises(NativeUnavailable, match="failed on bad.c"):
            build(bad, tmp_path / "out")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(NativeUnavailable, match="no-such-cc"):
        build(Path(SOURCE), tmp_path / "out")


def test_the_switch_turns_the_native_kernels_off_and_the_loader_keeps_int4():
    code = ("from kvstrata.kernels.quant_native import native_kernels, native_status\n"
            "from kvstrata.kernels import choose_cpu_path\nimport torch\n"
            "from test_quant_kernels import random_packed\n"
            "assert native_kernels() is None\nprint(native_status())\n"
            "c = choose_cpu_path(random_packed('Q4_0', 64, 64), (1,), reps=1, ring_bytes=0, allow_inexact=True)\n"
            "print(sorted(c.times_ms))\n"
            "from kvstrata.worker.model.loader import resolve_quantized\n"
            "print([resolve_quantized('auto', 'cpu', d) for d in ('float32', 'bfloat16', 'auto')])\n")
    done = run_python(code, KVSTRATA_NATIVE_KERNELS="0")
    assert done.returncode == 0, done.stderr
    assert "KVSTRATA_NATIVE_KERNELS=0" in done.stdout
    assert "['dense', 'dequant', 'int4']" in done.stdout
    # without our kernels "auto" packs only where bf16 activations are allowed anyway
    assert "['dequantize', 'packed', 'packed']" in done.stdout


@native
def test_the_isa_switch_picks_the_avx2_kernel_or_names_what_is_wrong():
    code = ("from kvstrata.kernels.quant_native import native_kernels, native_status\n"
            "k = native_kernels()\nprint(None if k is None else k.isa, native_status())\n")
    done = run_python(code, KVSTRATA_NATIVE_ISA="avx2")
    assert done.returncode == 0 and done.stdout.split() == ["avx2", "ok"], done.stderr
    done = run_python(code, KVSTRATA_NATIVE_ISA="neon")
    assert done.returncode == 0, done.stderr
    assert "None KVSTRATA_NATIVE_ISA must be one of avx512_bf16, avx2, got 'neon'" in done.stdout


@native
def test_auto_packs_a_gguf_on_this_cpu_at_every_dtype():
    from kvstrata.worker.model.loader import resolve_quantized

    assert [resolve_quantized("auto", "cpu", d) for d in ("float32", "float16", "bfloat16", "auto")] == ["packed"] * 4
    assert resolve_quantized("auto", "cuda", "float32") == "dequantize"
    assert resolve_quantized("dequantize", "cpu", "float32") == "dequantize"


@native
def test_a_weight_binds_its_kernel_call_once_and_drops_it_with_the_weight():
    import gc

    from kvstrata.kernels import quant_cpu

    packed = random_packed("Q4_1", 128, 64, seed=8)
    w = with_cpu_path(packed, "native", keep_blocks=False)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    first = quant_matmul(x, w)
    bound = quant_cpu._BOUND[w]
    assert torch.equal(quant_matmul(x, w), first) and quant_cpu._BOUND[w] is bound  # reused, same bits
    checked = torch.empty(3, 128)
    native_kernels().matmul("Q4_1", x, w.planes[0], checked)  # the checked call, bound afresh
    assert torch.equal(checked, first)
    before = len(quant_cpu._BOUND)
    del w, bound
    gc.collect()
    assert len(quant_cpu._BOUND) == before - 1
