"""Which implementation runs a kernel call, and lazy Triton kernel objects.

Rules (one place, so every entry point agrees):

    impl="torch"   -> the torch reference, on any device
    impl="triton"  -> the Triton kernel: compiled on CUDA tensors, the Triton
                      interpreter on CPU tensors
    impl="auto"    -> CUDA tensors: compiled Triton;
                      CPU tensors: the torch reference, unless TRITON_INTERPRET
                      is set in the environment, then the interpreted kernel

Triton is imported only when a Triton path is actually taken, so importing
kvstrata never imports triton (nor needs a GPU). Kernels are written as plain
functions and wrapped here per mode: ``triton.jit`` for CUDA and
``InterpretedFunction`` for CPU. Because the wrapping is explicit, the
interpreter works whether or not TRITON_INTERPRET was set before triton was
first imported (``triton.jit`` alone decides at decoration time).
"""

from __future__ import annotations

import os
from typing import Callable, Literal, Protocol

import torch

Impl = Literal["auto", "torch", "triton"]
IMPLS = ("auto", "torch", "triton")


class TritonKernel(Protocol):
    """A kernel as ``LazyKernel.for_device`` gives it (``triton.jit``'s
    JITFunction or the interpreter's InterpretedFunction): launched as
    ``kernel[grid](*args, **meta)``, or passed to another kernel as a constexpr."""

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., object]: ...


def interpret_requested() -> bool:
    """TRITON_INTERPRET set to a true value (triton's own spelling rules)."""
    value = os.environ.get("TRITON_INTERPRET")
    return bool(value) and value.strip().lower() in ("1", "true", "on", "yes")


def use_triton(impl: str, device: torch.device) -> bool:
    """True when the call should run the Triton kernel rather than the torch reference."""
    if impl == "auto":  # the hot case first (every kernel call of a model step): one device.type read
        kind = device.type
        return kind == "cuda" or (kind == "cpu" and interpret_requested())
    if impl == "torch":
        return False
    if impl == "triton":
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"impl='triton' needs CUDA or CPU tensors, got device {device}")
        return True
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


class LazyKernel:
    """One Triton kernel, wrapped on first use for the device it runs on.

    Owns: the compiled (``triton.jit``) and interpreted wrappers of ``fn``.
    They are pure functions of ``fn`` — a memo, not state callers observe.
    """

    __slots__ = ("_fn", "_compiled", "_interpreted", "_do_not_specialize")

    def __init__(self, fn: Callable[..., None], do_not_specialize: tuple[str, ...] = ()) -> None:
        """``do_not_specialize``: integer arguments that vary from call to call
        (token and sequence counts): compiled once for every value instead of
        once more whenever one is 1 or a multiple of 16, so no request pays a
        compile for a shape that warm-up did not happen to cover."""
        self._fn = fn
        self._compiled: TritonKernel | None = None
        self._interpreted: TritonKernel | None = None
        self._do_not_specialize = tuple(do_not_specialize)

    @property
    def __name__(self) -> str:
        return self._fn.__name__

    def for_device(self, device: torch.device) -> TritonKernel:
        """The launchable kernel (``kernel[grid](...)``) for tensors on ``device``."""
        if device.type == "cuda" and not interpret_requested():
            if self._compiled is None:
                import triton

                self._compiled = triton.jit(self._fn, do_not_specialize=self._do_not_specialize)
            return self._compiled
        if self._interpreted is None:
            from triton.runtime.interpreter import InterpretedFunction

            self._interpreted = InterpretedFunction(self._fn)
        return self._interpreted


def is_interpreted(device: torch.device) -> bool:
    """True when a Triton launch on ``device`` runs in the interpreter (its
    bf16/fp16 arithmetic is unreliable, so kernels upcast after loading)."""
    return device.type != "cuda" or interpret_requested()
