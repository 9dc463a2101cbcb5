"""What ONNX Runtime's MatMulNBits computes at accuracy_level 4, written out in numpy for the quantisation tests."""

from __future__ import annotations

import numpy as np

BLOCK = 32


def int8_blocks(x: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """x with each block of ``block`` values along the last axis rounded to int8 steps of max |block| / 127 (the
    activations of MatMulNBits at accuracy_level 4). The last axis must be a whole number of blocks."""
    b = x.reshape(*x.shape[:-1], -1, block)
    step = np.abs(b).max(-1, keepdims=True) / 127
    step[step == 0] = 1
    return (np.rint(b / step) * step).reshape(x.shape)
