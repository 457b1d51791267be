"""Compiling a Triton kernel for an sm_90 GPU on any host (triton's CUDA
backend and its bundled ptxas, no GPU): the one helper of the compile tests.
Importing it imports triton: import it after ``pytest.importorskip("triton")``."""

from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def compile_sm90(raw, types: dict[str, str], consts: dict[str, object], *, div16: tuple[str, ...] = (),
                 **options):
    """``raw`` (an undecorated kernel function) compiled for sm_90: ``types``
    its runtime arguments' triton types, ``consts`` its constexprs, ``div16``
    arguments the launcher would mark 16-divisible (aligned pointers, strides
    of 16), ``options`` num_warps etc. Skips where triton cannot compile
    for CUDA here (an older ASTSource, no bundled ptxas)."""
    fn = triton.jit(raw)
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    constexprs = {(fn.arg_names.index(name),): value for name, value in consts.items()}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in div16 if name in fn.arg_names}
    try:
        source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    except TypeError:  # pragma: no cover - triton < 3.3 spells this API differently
        pytest.skip("this triton's ASTSource takes no constexprs")
    try:
        return triton.compile(source, target=TARGET, options=options)
    except RuntimeError as e:  # pragma: no cover - only without the bundled ptxas
        if "ptxas" in str(e):
            pytest.skip(f"no ptxas: {e}")
        raise
