"""The native CPU kernels (kernels/csrc/lowbit_bf16.c via
kernels/quant_native.py). int4: against the exact model of the int4 planes
in float64, against torch's kernel on the same planes, its dispatch by
token count and the threshold ``choose_cpu_path`` sets. q6 (Q6_K) and q8
(Q8_0): against ``dequantize`` in float64, their rows bit-equal to it, their
place among the CPU paths. And the build cache.

Runs where the kernel builds and runs (a C compiler with OpenMP, an x86-64
CPU with AVX512_BF16: the CI host); elsewhere the kernel tests skip, naming
why, and the threshold rule and build errors are still tested."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch

from kvstrata.kernels import (
    KernelArgumentError,
    QuantScratch,
    choose_cpu_path,
    dequantize,
    quant_matmul,
    with_cpu_path,
)
from kvstrata.kernels.quant_cpu import (
    Int4Path,
    int4_rows,
    native_available,
    native_threshold,
    planes_rows,
    q6_rows,
    q8_rows,
)
from kvstrata.kernels.quant_native import SOURCE, NativeUnavailable, build, native_kernels, native_status

pytest.importorskip("gguf")
from test_quant_kernels import random_packed  # noqa: E402

native = pytest.mark.skipif(native_kernels() is None, reason=f"no native int4 kernel here: {native_status()}")


def planes_weight(w) -> torch.Tensor:
    """W as the int4 kernels read it (sum of the planes' (q - 8) * s + z), float64."""
    return int4_rows(w, torch.arange(w.out_features), torch.float32).double()


def exact(x: torch.Tensor, w) -> torch.Tensor:
    """x rounded to bf16 (as both kernels take it) @ W.T, in float64."""
    return x.to(torch.bfloat16).double() @ planes_weight(w).T


@native
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_K"])  # one plane (Q4_*), two (Q8_0, Q5_K)
@pytest.mark.parametrize("rows,cols", [(64, 256), (320, 512)])
@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 17])  # whole and partial 4-row tiles
def test_native_matches_the_planes_in_float64(qtype, rows, cols, tokens):
    w = with_cpu_path(random_packed(qtype, rows, cols, seed=tokens), "int4")
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(rows + tokens))
    acc = torch.full((tokens, rows), float("nan"))  # every entry must be written
    native_kernels().int4_matmul(x.to(torch.bfloat16), w.planes, acc)
    want = exact(x, w)
    scale = x.to(torch.bfloat16).double().abs() @ planes_weight(w).abs().T
    assert ((acc.double() - want).abs() <= 1e-5 * scale + 1e-30).all()
    # torch's kernel on the same planes: the same up to its bf16 output
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    theirs = sum(mm(x.to(torch.bfloat16), q, 32, sz).double() for q, sz in w.planes)
    assert ((theirs - want).abs() <= 2.0**-7 * scale * len(w.planes)).all()


@native
def test_native_writes_a_column_slice_of_a_wider_output_and_nothing_else():
    w = with_cpu_path(random_packed("Q4_1", 128, 64), "int4")
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    wide = torch.full((6, 256), 7.0)
    native_kernels().int4_matmul(x.to(torch.bfloat16), w.planes, wide[:, 64:192])
    assert torch.equal(wide[:, :64], torch.full((6, 64), 7.0)) and torch.equal(wide[:, 192:], torch.full((6, 64), 7.0))
    assert (wide[:, 64:192].double() - exact(x, w)).abs().max() <= 1e-4


@native
def test_native_gives_the_same_bits_on_one_thread_and_on_two():
    w = with_cpu_path(random_packed("Q4_K", 512, 256), "int4")
    xb = torch.randn(9, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(torch.empty(9, 512))
            native_kernels().int4_matmul(xb, w.planes, outs[-1])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])  # the blocks of 64 rows split over threads, each summed alike


@native
@pytest.mark.parametrize("qtype,path", [("Q4_1", "int4"), ("Q8_0", "int4"), ("Q6_K", "q6"), ("Q8_0", "q8")])
def test_native_rows_do_not_depend_on_the_batch(qtype, path):
    """A row's sums are the same bits alone (1-3 rows: unpacked straight
    into registers) as in a batch of 7 (4-row tiles and a rest of 3)."""
    w = with_cpu_path(random_packed(qtype, 192, 256), path)
    mm = native_kernels().int4_matmul if path == "int4" else kernel_of(path)
    xb = torch.randn(7, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    batch = torch.empty(7, 192)
    mm(xb, w.planes, batch)
    for lo, hi in ((0, 1), (1, 3), (4, 7), (6, 7)):
        part = torch.empty(hi - lo, 192)
        mm(xb[lo:hi].contiguous(), w.planes, part)
        assert torch.equal(part, batch[lo:hi]), (lo, hi)


@native
def test_int4_path_takes_the_native_kernel_from_native_from_tokens():
    base = with_cpu_path(random_packed("Q4_0", 128, 256), "int4")
    w = with_cpu_path(base, "int4", native_from=4)
    assert w.int4_native_from == 4 and base.int4_native_from is None
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    for tokens in (1, 3, 4, 9):
        x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens))
        got = quant_matmul(x, w)
        torch_side = mm(x.to(torch.bfloat16), base.planes[0][0], 32, base.planes[0][1]).float()
        native_side = torch.empty(tokens, 128)
        native_kernels().int4_matmul(x.to(torch.bfloat16), base.planes, native_side)
        assert torch.equal(got, native_side if tokens >= 4 else torch_side), tokens
    # a bf16 output: the float32 sums rounded once
    xb = torch.randn(5, 256, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    ref = torch.empty(5, 128)
    native_kernels().int4_matmul(xb, base.planes, ref)
    assert torch.equal(quant_matmul(xb, w), ref.to(torch.bfloat16))


@native
def test_choose_cpu_path_times_both_int4_kernels_and_sets_the_threshold():
    packed = random_packed("Q4_1", 256, 512)
    choice = choose_cpu_path(packed, (1, 16), dtype=torch.float32, reps=1, ring_bytes=0, allow_inexact=True)
    t = choice.times_ms
    assert {"int4/torch", "int4/native", "int4", "dequant", "dense"} <= set(t)
    assert choice.native_from == native_threshold((1, 16), t["int4/torch"], t["int4/native"])
    for tokens in (1, 16):
        side = "int4/native" if choice.native_from is not None and tokens >= choice.native_from else "int4/torch"
        assert t["int4"][tokens] == t[side][tokens]
    if choice.path == "int4":
        assert choice.weight.int4_native_from == choice.native_from
    else:
        assert choice.native_from is None or choice.weight.planes is None


def test_native_threshold_rule():
    lose, win = {1: 2.0, 4: 2.0, 16: 2.0}, {1: 1.0, 4: 1.0, 16: 1.0}
    mixed = lambda *wins: {t: (1.0 if w else 3.0) for t, w in zip((1, 4, 16), wins)}  # noqa: E731
    assert native_threshold((1, 16), {1: 1.0, 16: 9.0}, {1: 1.2, 16: 5.0}) == 4  # between 1 and 16
    assert native_threshold((1, 4, 16), lose, win) == 1
    assert native_threshold((1, 4, 16), win, lose) is None
    assert native_threshold((1, 4, 16), lose, mixed(False, True, True)) == 2
    assert native_threshold((1, 4, 16), lose, mixed(False, False, True)) == 8
    assert native_threshold((1, 4, 16), lose, mixed(True, False, True)) == 8  # from 16 on only
    assert native_threshold((1, 4, 16), lose, mixed(True, True, False)) is None  # slower at the largest
    assert native_threshold((16, 4), {4: 1.0, 16: 9.0}, {4: 2.0, 16: 1.0}) == 8  # any order


@pytest.mark.parametrize("case", ["path", "zero", "bool", "rows"])
def test_native_from_errors_name_what_is_wrong(case):
    packed = random_packed("Q4_0", 80, 64)  # 80 rows: int4 yes (% 16), native no (% 64)
    good = random_packed("Q4_0", 64, 64)
    call, match = {
        "path": (lambda: with_cpu_path(good, "dequant", native_from=4), "needs path 'int4'"),
        "zero": (lambda: with_cpu_path(good, "int4", native_from=0), "token count >= 1"),
        "bool": (lambda: with_cpu_path(good, "int4", native_from=True), "token count >= 1"),
        "rows": (lambda: with_cpu_path(packed, "int4", native_from=4), "out_features % 64"),
    }[case]
    with pytest.raises(KernelArgumentError, match=match):
        call()
    assert not native_available(packed)


@native
@pytest.mark.parametrize("case", ["x_dtype", "x_strided", "acc_dtype", "acc_rows", "cols", "sz_shape", "planes"])
def test_native_matmul_argument_errors(case):
    w = with_cpu_path(random_packed("Q4_0", 64, 64), "int4")
    xb, acc = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 64)
    q, sz = w.planes[0]
    args, match = {
        "x_dtype": ((xb.float(), w.planes, acc), "xb must be a contiguous 2-D bfloat16"),
        "x_strided": ((torch.zeros(2, 128, dtype=torch.bfloat16)[:, ::2], w.planes, acc), "xb must be"),
        "acc_dtype": ((xb, w.planes, acc.double()), "acc must be float32"),
        "acc_rows": ((xb, w.planes, torch.zeros(3, 64)), "acc must be float32 \\[2, N\\]"),
        "cols": ((xb, w.planes, torch.zeros(2, 128)[:, ::2]), "contiguous rows"),
        "sz_shape": ((xb, ((q, sz[:1]),), acc), "scales_and_zeros must be"),
        "planes": ((xb, (), acc), "at least one"),
    }[case]
    with pytest.raises(KernelArgumentError, match=match):
        native_kernels().int4_matmul(*args)


@pytest.mark.skipif(shutil.which("cc") is None and not os.environ.get("CC"), reason="no C compiler")
def test_build_is_cached_by_source_and_rebuilt_when_it_changes(tmp_path):
    src = tmp_path / "k.c"
    src.write_text("int kvq_abi_version(void) { return 1; }\n")
    first = build(src, tmp_path / "out")
    mtime = first.stat().st_mtime_ns
    assert build(src, tmp_path / "out") == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    src.write_text("int kvq_abi_version(void) { return 2; }\n")
    second = build(src, tmp_path / "out")
    assert second != first and second.is_file()
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


@native
def test_scratch_is_not_needed_and_planes_are_read_in_place():
    """The native kernel reads torch's planes as they are: no repacked copy
    (resident bytes unchanged by native_from)."""
    w = with_cpu_path(random_packed("Q8_0", 128, 128), "int4")
    n = with_cpu_path(w, "int4", native_from=1)
    assert n.nbytes == w.nbytes and all(a[0] is b[0] for a, b in zip(n.planes, w.planes))
    x = torch.randn(4, 128)
    out = torch.empty(4, 128)
    Int4Path.matmul(x, n, None, out, QuantScratch())
    assert (out.double() - exact(x, w)).abs().max() <= 1e-4
    assert dataclasses.replace(n, int4_native_from=None).int4_native_from is None


def test_the_switch_turns_the_native_kernel_off_and_says_so():
    import subprocess
    import sys

    code = ("from kvstrata.kernels.quant_native import native_kernels, native_status\n"
            "assert native_kernels() is None\nprint(native_status())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KVSTRATA_NATIVE_KERNELS": "0"})
    assert done.returncode == 0, done.stderr
    assert "KVSTRATA_NATIVE_KERNELS=0" in done.stdout


# ---- Q6_K and Q8_0: the q6 and q8 paths (the file's bytes re-laid, weights exact) -------------

REPACKED = [("Q6_K", "q6"), ("Q8_0", "q8")]


def exact_blocks(x: torch.Tensor, w) -> torch.Tensor:
    """x rounded to bf16 @ the dequantized weight, float64."""
    return x.to(torch.bfloat16).double() @ dequantize(w).double().T


def kernel_of(path: str):
    return native_kernels().q6k_matmul if path == "q6" else native_kernels().q8_matmul


@native
@pytest.mark.parametrize("qtype,path", REPACKED)
@pytest.mark.parametrize("rows,cols", [(64, 256), (320, 512)])
@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 17])
def test_repacked_paths_match_dequantize_in_float64(qtype, path, rows, cols, tokens):
    packed = random_packed(qtype, rows, cols, seed=tokens)
    w = with_cpu_path(packed, path)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(rows + tokens))
    acc = torch.full((tokens, rows), float("nan"))
    kernel_of(path)(x.to(torch.bfloat16), w.planes, acc)
    scale = x.to(torch.bfloat16).double().abs() @ dequantize(packed).double().abs().T
    assert ((acc.double() - exact_blocks(x, packed)).abs() <= 1e-5 * scale + 1e-30).all()


@native
@pytest.mark.parametrize("qtype,path", REPACKED)
def test_repacked_paths_through_quant_matmul_with_bias_slices_and_bf16(qtype, path):
    packed = random_packed(qtype, 128, 256, seed=4)
    w = with_cpu_path(packed, path, keep_blocks=False)
    assert w.data is None and w.nbytes == packed.nbytes  # the file's bytes, re-laid
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(128, generator=torch.Generator().manual_seed(6))
    wide = torch.full((6, 320), 3.0)
    quant_matmul(x, w, bias, out=wide[:, 64:192])
    scale = x.to(torch.bfloat16).double().abs() @ dequantize(packed).double().abs().T  # random scales: sums ~1e3
    assert ((wide[:, 64:192].double() - exact_blocks(x, packed) - bias.double()).abs() <= 1e-5 * scale).all()
    assert torch.equal(wide[:, :64], torch.full((6, 64), 3.0)) and torch.equal(wide[:, 192:], torch.full((6, 128), 3.0))
    got = quant_matmul(x.to(torch.bfloat16), w)
    assert got.dtype == torch.bfloat16
    assert (got.double() - exact_blocks(x, packed)).abs().max() <= 2.0**-7 * exact_blocks(x, packed).abs().max()


@native
@pytest.mark.parametrize("qtype,path", REPACKED)
def test_repacked_rows_are_bit_equal_to_dequantize(qtype, path):
    packed = random_packed(qtype, 192, 512, seed=7)
    w = with_cpu_path(packed, path, keep_blocks=False)
    ids = torch.tensor([0, 1, 15, 16, 31, 32, 47, 48, 63, 64, 100, 191, 5, 5])
    rows = {"q6": q6_rows, "q8": q8_rows}[path]
    assert torch.equal(rows(w, ids, torch.float32), dequantize(packed)[ids])
    assert torch.equal(planes_rows(w, ids, torch.bfloat16), dequantize(packed)[ids].to(torch.bfloat16))
    with pytest.raises(KernelArgumentError, match=f"no {path} planes"):
        rows(with_cpu_path(random_packed("Q4_0", 64, 64), "int4"), ids[:1], torch.float32)


@native
@pytest.mark.parametrize("qtype,path", REPACKED)
def test_repacked_paths_are_candidates_only_for_inexact_activations(qtype, path):
    packed = random_packed(qtype, 256, 512, seed=8)
    exact_only = choose_cpu_path(packed, (1,), dtype=torch.float32, reps=1, ring_bytes=0)
    assert path not in exact_only.times_ms and exact_only.path == "dequant"
    fast = choose_cpu_path(packed, (1, 16), dtype=torch.float32, reps=2, ring_bytes=0, allow_inexact=True)
    assert path in fast.times_ms
    if fast.path == path:
        assert fast.weight.cpu_path == path and fast.weight.planes is not None and fast.native_from is None


@native
@pytest.mark.parametrize("case", ["k", "planes", "q_shape", "d_dtype"])
def test_q8_matmul_argument_errors(case):
    w = with_cpu_path(random_packed("Q8_0", 64, 64), "q8")
    xb, acc = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 64)
    q, d = w.planes[0]
    args, match = {
        "k": ((torch.zeros(2, 48, dtype=torch.bfloat16), w.planes, acc), "K % 32"),
        "planes": ((xb, ((q,),), acc), "\\(\\(q, d\\),\\)"),
        "q_shape": ((xb, ((q[:, :1], d),), acc), "planes q must be contiguous int8"),
        "d_dtype": ((xb, ((q, d.float()),), acc), "planes d must be contiguous float16"),
    }[case]
    with pytest.raises(KernelArgumentError, match=match):
        native_kernels().q8_matmul(*args)


@native
@pytest.mark.parametrize("case", ["k", "planes", "lo_shape", "sc_dtype"])
def test_q6_matmul_argument_errors(case):
    w = with_cpu_path(random_packed("Q6_K", 64, 256), "q6")
    xb, acc = torch.zeros(2, 256, dtype=torch.bfloat16), torch.zeros(2, 64)
    lo, hi, sc, d = w.planes[0]
    args, match = {
        "k": ((torch.zeros(2, 128, dtype=torch.bfloat16), w.planes, acc), "K % 256"),
        "planes": ((xb, w.planes + w.planes, acc), "\\(\\(lo, hi, sc, d\\),\\)"),
        "lo_shape": ((xb, ((lo[:, :128], hi, sc, d),), acc), "planes lo must be contiguous uint8"),
        "sc_dtype": ((xb, ((lo, hi, sc.to(torch.uint8), d),), acc), "planes sc must be contiguous int8"),
    }[case]
    with pytest.raises(KernelArgumentError, match=match):
        native_kernels().q6k_matmul(*args)


@pytest.mark.parametrize("qtype,path", REPACKED)
def test_repacked_paths_need_their_type_and_whole_row_blocks(qtype, path):
    with pytest.raises(KernelArgumentError, match=f"{path} CPU path needs a {qtype}"):
        with_cpu_path(random_packed(qtype, 16, 256), path)  # 16 rows: not a multiple of 64
    with pytest.raises(KernelArgumentError, match=f"{path} CPU path needs a {qtype}"):
        with_cpu_path(random_packed("Q4_0", 64, 256), path)
