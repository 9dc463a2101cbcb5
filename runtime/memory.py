"""How much memory a request may take: checked before the allocation, with the number of bytes. Standard library only."""

from __future__ import annotations

import os

from edgelin.errors import RuntimeInputError


def available_memory() -> int | None:
    """Bytes available to a new allocation (Linux MemAvailable, else free physical pages), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_bytes(need: int, what: str, fix: str, error: type[Exception] = RuntimeInputError) -> None:
    """Raise ``error`` if ``need`` bytes exceed the memory available now (or 2**48 bytes where unknown)."""
    have = available_memory()
    limit = have if have is not None else 1 << 48
    if need > limit:
        where = f"{have:,} bytes are available" if have is not None else "that is more than this machine can hold"
        raise error(f"{what} needs {need:,} bytes but {where}; {fix}")


__all__ = ["available_memory", "check_bytes"]
