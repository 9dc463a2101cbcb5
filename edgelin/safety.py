"""Checks on a model before edgelin spends time (or memory) on it: finite weights; config shapes
against a safetensors header without allocating the model. Uses torch; not imported by ``import edgelin``."""

from __future__ import annotations

from pathlib import Path

import torch

from edgelin.errors import CheckpointError, NonFiniteError
from edgelin.runtime.memory import available_memory


FINITE_PIECE = 1 << 22  # elements checked at a time: torch.isfinite makes temporaries the size of its input


def _finite(t: torch.Tensor) -> bool:
    flat = t.detach().reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + FINITE_PIECE]).all()) for i in range(0, flat.numel(), FINITE_PIECE))


def check_finite_weights(model: torch.nn.Module) -> None:
    """Raise NonFiniteError naming the first parameter or buffer that holds NaN or an infinity."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in tensors:
        if t.is_floating_point() and not _finite(t):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            raise NonFiniteError(
                f"weight {name!r} holds {nan} NaN and {inf} infinite value(s) of {t.numel()}; "
                "an export of it would compute garbage -- fix or retrain the checkpoint"
            )


def header_shapes(weights: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, read from a safetensors file's header alone (no tensor is loaded)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"{weights} is not a readable safetensors file ({first[:200]})") from None


def config_bytes(cfg) -> int:
    """An upper estimate of a LinearLM's float32 weights for ``cfg`` (embedding, attention, MLP, head)."""
    inner = cfg.n_heads * cfg.head_dim
    per_layer = 4 * cfg.d_model * inner + 3 * cfg.d_model * cfg.mlp_hidden + 4 * inner * max(cfg.conv_size, 1) + 8 * cfg.d_model
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    return 4 * (cfg.vocab_size * cfg.d_model + head + cfg.n_layers * per_layer) + (1 << 20)


def expected_shapes(build, cfg=None) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the state dict of ``build()``, built on torch's meta device: no memory is spent,
    whatever the config's sizes. Where a part of the model cannot be built on the meta device (a feature
    map that computes a constant from its random features), it is built on the CPU -- after checking
    that the weights ``cfg`` implies fit into the memory available."""
    try:
        with torch.device("meta"):
            model = build()
    except (RuntimeError, NotImplementedError):
        need, have = (config_bytes(cfg) if cfg is not None else 0), available_memory()
        if have is not None and need > have:
            raise CheckpointError(
                f"this config needs about {need:,} bytes of weights but {have:,} bytes of memory are available; "
                "check d_model, n_layers, n_heads, head_dim and vocab_size in config.json"
            ) from None
        model = build()
    return {n: tuple(t.shape) for n, t in model.state_dict().items()}


def shape_problems(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]) -> list[str]:
    """What differs between the shapes a config implies and the ones a weights file holds."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(n for n in set(expected) & set(found) if expected[n] != found[n])
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''}")
    if wrong:
        n = wrong[0]
        problems.append(f"shape of {n} is {found[n]}, config expects {expected[n]}" + (f" (+{len(wrong) - 1} more)" if len(wrong) > 1 else ""))
    return problems


__all__ = ["check_finite_weights", "expected_shapes", "header_shapes", "shape_problems"]
