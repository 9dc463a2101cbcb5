"""``edgelin.upstream_run.interpret_on_cpu``: Triton's interpreter, as the fla oracle and validate's upstream run
use it, computes what it computed before, and leaves ``triton.language`` as it found it.

A kernel that calls a device function (as fla's kernels do) runs with the interpreter as Triton ships it and with
the language patched once per kernel: the outputs are bit for bit equal, the device functions' repeated patching
is skipped, and after each kernel every attribute of triton.language is the original one.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch

from edgelin.upstream_run import interpret_on_cpu

triton = pytest.importorskip("triton", reason="triton is not installed; pip install -e '.[test]'")
tl = importlib.import_module("triton.language")
interpreter = importlib.import_module("triton.runtime.interpreter")


@triton.jit
def _gate(x, y):
    return tl.sigmoid(x) * y + tl.exp(-x * x)


@triton.jit
def _kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    acc = x
    for _ in range(3):  # the device function called several times per program
        acc = _gate(acc, y)
    tl.store(out_ptr + offs, acc, mask=mask)


def _run(n: int = 70) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    out = torch.empty(n)
    _kernel[(triton.cdiv(n, 32),)](x, y, out, n, BLOCK=32)
    return out


def _language() -> dict:
    """triton.language's own attributes (the kernel's patch; what device functions patch in triton.language.core
    Triton never undoes, with or without the wrapper)."""
    return dict(vars(tl))


def test_once_per_kernel_computes_what_the_interpreter_did_and_restores_the_language(monkeypatch):
    if not isinstance(_kernel, interpreter.InterpretedFunction):
        pytest.skip("TRITON_INTERPRET was not set when the kernel was defined (tests/importers/conftest.py sets it)")
    current = interpreter._patch_lang
    shipped = getattr(current, "shipped", current)  # the fla oracle may have installed the wrapper in this process
    before = _language()
    calls = []

    def counting(fn):
        calls.append(fn.__name__)
        return shipped(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", counting)  # the original is put back after the test
    reference = _run()
    # the launch, then every call of a device function (_gate, and tl.sigmoid inside it) in each of 3 programs
    assert calls == ["_kernel"] + ["_gate", "sigmoid"] * 3 * 3, calls
    assert _language() == before

    calls.clear()
    interpret_on_cpu()  # wraps `counting`: what it lets through is counted
    assert torch.equal(_run(), reference)
    # the launch patches triton.language; _gate sees it patched; tl.sigmoid's module (triton.language.core) is
    # patched at its first call and never again in this launch
    assert calls == ["_kernel", "sigmoid"], calls
    assert _language() == before, "triton.language left patched"
    interpret_on_cpu()  # idempotent: not wrapped twice
    calls.clear()
    assert torch.equal(_run(), reference) and calls == ["_kernel", "sigmoid"]


def test_the_autotuner_keeps_the_config_with_the_largest_blocks():
    """One config, no benchmark (it needs a GPU): the largest product of block sizes, the first of equals; a kernel
    run through the autotuner then launches the fewest programs and computes what it computes with any block."""
    from edgelin.upstream_run import fewest_programs

    configs = [triton.Config({"BLOCK": 8}, num_warps=4), triton.Config({"BLOCK": 32, "ROWS": 2}, num_warps=2),
               triton.Config({"BLOCK": 64, "ROWS": 1}, num_warps=8), triton.Config({"BLOCK": 16, "ROWS": 4})]
    assert fewest_programs(types.SimpleNamespace(configs=configs), {}) == [configs[1]]  # 64 = 32 x 2 = 64 x 1: the first
    if not isinstance(_kernel, interpreter.InterpretedFunction):
        pytest.skip("TRITON_INTERPRET was not set when the kernel was defined (tests/importers/conftest.py sets it)")
    interpret_on_cpu()
    blocks = []

    @triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in (8, 64, 16)], key=["n"])
    @triton.jit
    def tuned(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        _kernel.fn(x_ptr, y_ptr, out_ptr, n, BLOCK)  # _kernel's body (the interpreter runs it as Python)

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(70, generator=gen), torch.randn(70, generator=gen)
    out = torch.empty(70)
    tuned[lambda meta: (blocks.append(meta["BLOCK"]) or triton.cdiv(70, meta["BLOCK"]),)](x, y, out, 70)
    assert blocks == [64] and torch.equal(out, _run())  # _run: the same kernel in blocks of 32
