"""A random-init checkpoint of a published configuration, written shard by shard without building the model in memory.

    python scripts/shard_checkpoint.py qwen3.5-4b OUT_FOLDER [--dtype bfloat16] [--shard-gb 2] [--seed 0]

transformers builds the model on the meta device (no memory) to learn each parameter's and persistent buffer's name,
shape and owning module; then, module by module, that module alone is materialised on CPU, initialised by the model's
own ``_init_weights`` (as ``from_config`` does), converted to ``--dtype``, written into the current shard and dropped.
Resident memory stays at about the largest module (the embedding, vocab x hidden in fp32) plus one shard.

The folder is what ``save_pretrained`` writes: ``model-0000i-of-0000n.safetensors`` shards (``model.safetensors`` when
one suffices) with ``model.safetensors.index.json`` (``metadata``: total_parameters, total_size; ``weight_map``),
tied weights dropped as ``save_pretrained`` drops them, ``config.json`` and ``generation_config.json``; and a
byte-level BPE tokenizer of the vocabulary (``--no-tokenizer``: none), which onnxruntime-genai's builder and llama.cpp's
converter need. It is written into a temporary folder beside OUT_FOLDER and renamed at the end.

Differences from transformers' own init: each module is initialised alone, so an ``_init_weights`` that writes a
child's tensors from the parent's branch writes them before the child exists (none of qwen3_5_text, lfm2, lfm2_moe
does); the random stream differs from ``from_config``'s (same distributions, other draws).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DTYPES = ("bfloat16", "float16", "float32")


def published(name: str) -> tuple[str, dict[str, Any]]:
    """(model_type, config) of a published configuration by name (edgelin.bench.checkpoints.PUBLISHED)."""
    from edgelin.bench.checkpoints import PUBLISHED

    if name not in PUBLISHED:
        raise SystemExit(f"unknown model {name!r}: pick one of {', '.join(sorted(PUBLISHED))}")
    return PUBLISHED[name]


def meta_model(model_type: str, config: dict[str, Any]):
    """(config, model) of transformers' AutoModelForCausalLM built on the meta device: shapes and names, no memory."""
    sys.modules.setdefault("fla", None)  # type: ignore[arg-type]  # transformers' own PyTorch modules
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return cfg, model


def saved_tensors(model) -> list[tuple[str, Any, list[str]]]:
    """(module name, module, [local tensor names]) in module order for every module owning a tensor that
    ``save_pretrained`` writes: parameters (a tied parameter under its first name only) and persistent buffers."""
    seen: set[int] = set()
    plan = []
    for mod_name, module in model.named_modules():
        local = []
        for name, p in module.named_parameters(recurse=False):
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                local.append(name)
        for name, b in module.named_buffers(recurse=False):
            if b is not None and name not in module._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                local.append(name)
        if local:
            plan.append((mod_name, module, local))
    return plan


def shard_plan(sizes: list[tuple[str, int]], shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped greedily in order into shards of at most ``shard_bytes`` (a tensor larger than that alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """save_pretrained's file names for ``count`` shards."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_tokenizer(folder: Path, vocab_size: int, log=print) -> None:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` tokens (``edgelin.bench.checkpoints.byte_level_tokenizer``) saved
    in ``folder``, where the vocabulary allows one (up to 65,792 tokens); said, not written, otherwise."""
    import transformers

    from edgelin.bench.checkpoints import byte_level_tokenizer
    from edgelin.bench.plan import BenchError

    try:
        tok = byte_level_tokenizer(vocab_size)
    except BenchError as exc:
        log(f"no tokenizer written: {exc}")
        return
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)


def write_checkpoint(model_type: str, config: dict[str, Any], out: Path, dtype: str = "bfloat16", shard_gb: float = 2.0,
                     seed: int = 0, log=print, tokenizer: bool = True) -> dict[str, Any]:
    """Write the random-init checkpoint into ``out`` (which must not exist); returns {params, bytes, shards, seconds}.
    ``tokenizer``: a byte-level BPE tokenizer of the vocabulary beside it (``write_tokenizer``), so that tools which read
    a folder's tokenizer (onnxruntime-genai's builder, llama.cpp's converter) take the folder."""
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists():
        raise SystemExit(f"{out} exists: remove it or name another folder")
    if dtype not in DTYPES:
        raise SystemExit(f"--dtype {dtype}: pick one of {', '.join(DTYPES)}")
    torch_dtype = getattr(torch, dtype)
    start = time.perf_counter()
    torch.manual_seed(seed)
    cfg, model = meta_model(model_type, config)
    plan = saved_tensors(model)
    prefix = lambda mod_name, name: f"{mod_name}.{name}" if mod_name else name  # noqa: E731
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    from transformers.core_model_loading import revert_weight_conversion

    def saved(mod_name: str, module, local: list[str]) -> dict[str, torch.Tensor]:
        """The module's tensors under the checkpoint's names, as save_pretrained writes them (its weight conversions
        reverted, e.g. fused experts split per expert)."""
        return revert_weight_conversion(model, {prefix(mod_name, name): getattr(module, name) for name in local})

    sizes = []
    for mod_name, module, local in plan:
        for name, t in saved(mod_name, module, local).items():
            sizes.append((name, math.prod(t.shape) * (itemsize if t.is_floating_point() else t.element_size())))
    shards = shard_plan(sizes, int(shard_gb * 1e9))
    files = shard_names(len(shards))
    file_of = {name: files[i] for i, names in enumerate(shards) for name in names}
    total = sum(s for _, s in sizes)
    params = sum(p.numel() for p in model.parameters())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        current: dict[str, torch.Tensor] = {}
        shard_index, written = 0, 0

        def flush() -> None:
            nonlocal current, shard_index, written
            save_file(current, str(tmp / files[shard_index]), metadata={"format": "pt"})
            written += sum(t.numel() * t.element_size() for t in current.values())
            log(f"{files[shard_index]}: {len(current)} tensors, {written / 1e9:.2f} / {total / 1e9:.2f} GB", flush=True)
            current, shard_index = {}, shard_index + 1

        with torch.no_grad():
            for mod_name, module, local in plan:
                module.to_empty(device="cpu", recurse=False)
                model._init_weights(module)
                for full, t in saved(mod_name, module, local).items():
                    if file_of[full] != files[shard_index]:
                        flush()
                    current[full] = (t.to(torch_dtype) if t.is_floating_point() else t).contiguous()
                module.to_empty(device="meta", recurse=False)  # frees this module's float32 tensors
            flush()
        if len(files) > 1:
            index = {"metadata": {"total_parameters": params, "total_size": total}, "weight_map": file_of}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        cfg.dtype = torch_dtype
        cfg.architectures = [type(model).__name__]
        cfg.save_pretrained(tmp)
        if model.can_generate() and model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer:
            write_tokenizer(tmp, int(config["vocab_size"]), log)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's folder is private: the mode save_pretrained's folder would have
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"params": params, "bytes": total, "shards": len(files), "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a name of edgelin.bench.checkpoints.PUBLISHED, e.g. qwen3.5-4b")
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-tokenizer", action="store_true", help="write no byte-level tokenizer beside the weights")
    args = ap.parse_args(argv)
    if args.out.exists():
        print(f"{args.out} exists: remove it or name another folder", file=sys.stderr)
        return 2
    model_type, config = published(args.model)
    got = write_checkpoint(model_type, config, args.out, args.dtype, args.shard_gb, args.seed, tokenizer=not args.no_tokenizer)
    print(json.dumps(got))
    return 0


if __name__ == "__main__":
    sys.exit(main())
