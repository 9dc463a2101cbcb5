"""One way to run torch with a given number of intra-op threads for a while.

Token-by-token comparisons and timings run on tiny tensors, where one thread is fastest; on a small
shared machine torch's default pool made such loops ~100x slower (threads wait on each other).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch.set_num_threads(n) inside the block; the previous count is restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


__all__ = ["torch_threads"]
