"""The rows of the CLI bad-input tables (tests/cli/test_bad_inputs.py, tests/cli/test_nothing_lost.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass
class Case:
    args: list[str]
    expect: str  # a piece of the error line
    setup: Callable[[Path], None] | None = None

