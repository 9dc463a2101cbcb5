"""``validate``: every check group in order on one export, against its checkpoint, into one ``Report``."""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

from edgelin import parity, protocol, quantref, streaming
from edgelin.checkpoint import load_checkpoint, model_sha256, open_checkpoint
from edgelin.errors import EdgelinError, ManifestError, ProviderError
from edgelin.runtime import golden
from edgelin.runtime.manifest import Manifest
from edgelin.runtime.options import check_int
from edgelin.runtime.providers import EXECUTION_PROVIDERS
from edgelin.runtime.session import Session
from edgelin.threads import torch_threads
from edgelin.validate.behaviour import behaviour, greedy_agreement, heldout, heldout_text
from edgelin.validate.long import kv_cache, long_stream
from edgelin.validate.prefill_decode import decode_vs_torch, graphs_agree, prefill_vs_torch, ragged_agrees
from edgelin.validate.report import FAIL, NA, PASS, Check, Report
from edgelin.validate.routing import routing_agreement
from edgelin.validate.runtime_check import golden_outputs, provider_vs_cpu
from edgelin.validate.structure import check_structure, contract_mismatch, resolve_checkpoint
from edgelin.validate.upstream_checks import against_upstream, upstream_plan
from edgelin.validate.validator import Progress, Validator

KV_LENGTHS = (1024, 16384)  # a KV cache (and every other state) after prompts this long vs float64 (the "kv" group)


def validate(
    export_dir: str | Path,
    checkpoint=None,
    *,
    providers: str | list[str] = "cpu",
    steps: int = 64,
    long: int = 0,
    seed: int = 0,
    threads: int = 1,
    progress: Progress | None = None,
    heldout_bytes: int = 8192,
    budget=None,
    upstream: str = "auto",
    kv: Sequence[int] = KV_LENGTHS,
    prepack: bool = True,
) -> Report:
    """Run every check on ``export_dir`` against ``checkpoint`` (a folder, a model that follows
    edgelin.protocol, or None = the bundled model).

    The comparisons run token by token on small tensors, where one thread is fastest (and extra threads
    only contend): torch and the ONNX Runtime sessions use ``threads`` (default 1) while this runs.

    ``budget``: bounds to hold the export to instead of edgelin's for its precision, as {kind: {bound:
    value}} or ``KIND.BOUND=VALUE`` strings (``edgelin.parity.parse_override``); they apply over those the
    export was made with (``edgelin export --budget``, the manifest's ``parity_budgets``). The report
    records every bound it held and which were set.

    ``upstream``: for a foreign checkpoint folder (transformers', fla's), also run the framework it came from on the
    same ids and compare it with the import and with the graphs (the "upstream" group; edgelin.upstream). "auto": where
    the framework is installed (otherwise the group says what it could not compare and how to enable it); "required":
    an EdgelinError before anything runs where it cannot be made; "off": not at all.

    ``kv``: for a model with a KV cache (a hybrid), prompt lengths whose cache (and every other state) after the
    prompt is compared with the float64 model's (the "kv" group; default 1k and 16k, each within the model's declared
    context; () for none). Costs a float64 PyTorch run over each prompt.

    ``prepack``: the CPU session as the runtime loads it by default (True: ONNX Runtime packs each MatMul weight
    into a copy of its own) or with the weights read in place from the weights file (``Session(prepack=False)``:
    the same kernels on unpacked weights, one copy of the weights fewer beside the float64 model).
    """
    with torch_threads(threads if isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1 else 1), \
            contextlib.ExitStack() as scratch:
        return _validate(export_dir, checkpoint, providers, steps, long, seed, threads, progress, heldout_bytes, budget, upstream, kv,
                         prepack=prepack, scratch=scratch)


def budgets_for(manifest: Manifest, budget=None) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """(the budgets an export is held to, the bounds set over edgelin's): edgelin's for the precision, then
    the export's own ``parity_budgets``, then ``budget`` (a mapping or ``KIND.BOUND=VALUE`` strings)."""
    given = parity.overrides_of(budget) if budget is None or isinstance(budget, (list, tuple)) else budget
    return parity.held(manifest.precision, manifest.extra.get("parity_budgets"), given)


def _validate(export_dir, checkpoint, providers, steps, long, seed, threads, progress, heldout_bytes=8192, budget=None,
              upstream="auto", kv=KV_LENGTHS, prepack=True, scratch: contextlib.ExitStack | None = None) -> Report:
    say = progress or (lambda _m: None)
    t_start = time.perf_counter()
    requested = _parse_providers(providers)
    for name, value, low, high in (("steps", steps, 1, 100_000), ("long", long, 0, 1_000_000), ("threads", threads, 1, 256),
                                   ("seed", seed, 0, 2**63 - 1), ("heldout_bytes", heldout_bytes, 514, 1 << 24)):
        check_int(name, value, low=low, high=high, error=EdgelinError)
    if isinstance(kv, (str, bytes)) or not isinstance(kv, Sequence):
        raise EdgelinError(f"kv must be a list of prompt lengths, got {kv!r}")
    kv = [check_int("kv length", n, low=1, high=1 << 20, error=EdgelinError) for n in kv]
    export_dir = Path(export_dir)
    manifest = Manifest.load(export_dir)
    budgets, overrides = budgets_for(manifest, budget)
    in_memory = isinstance(checkpoint, torch.nn.Module)
    if in_memory:
        protocol.check_model(checkpoint)
        model, ckpt_path = checkpoint.float().eval(), None
    else:
        ckpt_path = open_checkpoint(resolve_checkpoint(manifest, checkpoint))  # the folder read once: config, files, hash
        folder = scratch_folder(export_dir, scratch, say)
        if folder is not None:
            say(f"loading {ckpt_path}: its weights read one tensor at a time into a scratch file in {folder} and mapped "
                "(removed when validate ends) ...")
        with streaming.mapped_weights(folder) if folder is not None else contextlib.nullcontext():
            model = load_checkpoint(ckpt_path)
    chunk = manifest.extra.get("chunk_size")
    if isinstance(chunk, int) and hasattr(model, "with_chunk_size"):  # exported with --chunk-size
        model = model.with_chunk_size(chunk).eval()
    framework, no_upstream, upstream_dtype = upstream_plan(upstream, ckpt_path)

    report = Report(str(export_dir), str(ckpt_path or "<in-memory model>"), manifest.precision, {},
                    strict_providers=providers != "auto", budgets=budgets, overrides=overrides, prepack=prepack)
    say("structure ...")
    for c in check_structure(export_dir, manifest, ckpt_path, model):
        report.checks.append(c)
    if in_memory:
        ok = model_sha256(checkpoint) == manifest.source
        report.checks.append(Check("structure", "source weights", PASS if ok else FAIL, where="" if ok else "model weights hash != manifest source"))

    try:
        # the hash check is a structure check of its own above: the numbers are still compared where the
        # files differ, to say where they diverge
        cpu = Session(export_dir, provider="cpu", threads=threads, check_hashes=False, prepack=prepack)
    except ManifestError as exc:
        report.checks.append(Check("structure", "runtime can load the export", FAIL, where=str(exc)))
        report.seconds = time.perf_counter() - t_start
        return report
    report.providers["cpu"] = "active"
    mismatch = contract_mismatch(model, manifest)
    if mismatch:  # nothing can be compared: the numbers would be of two different models
        report.checks.append(Check("structure", "checkpoint's model <-> export", FAIL,
                                   where=f"{mismatch}: pass the checkpoint this export was made from"))
        report.seconds = time.perf_counter() - t_start
        return report
    v = Validator(export_dir, model, manifest, budgets, seed, say, overrides, scratch=None if in_memory else folder)
    if v.quantised is not None:
        report.state_reference = quantref.arithmetic(manifest) or ""
    say("prefill vs PyTorch ...")
    prefill_vs_torch(v, cpu)
    say("decode vs PyTorch ...")
    decode_vs_torch(v, cpu, steps)
    say("prefill vs decode ...")
    graphs_agree(v, cpu)
    if manifest.lengths is not None:
        ragged_agrees(v, cpu)
    say("golden outputs ...")
    try:
        gold = golden.Golden.load(export_dir, manifest)
    except ManifestError as exc:
        gold = None
        v.add(Check("golden", "golden outputs (golden.json)", FAIL, where=str(exc)))
    if gold is not None:
        golden_outputs(v, cpu, gold)
    elif "golden" not in manifest.extra:
        v.add(Check("golden", "golden outputs (golden.json)", NA, where="this export has none (made by an earlier edgelin)"))
    plan = golden.plan_for(manifest.vocab_size, v.chunk, manifest.min_sequence, seed=seed, steps=steps,
                           max_positions=manifest.max_positions)  # the fixed inputs fit the declared context
    cpu_rows = golden.run_plan(cpu, plan) if len(requested) > 1 else None
    for name in requested:
        if name == "cpu":
            continue
        say(f"provider {name} ...")
        try:
            other = Session(export_dir, provider=name, threads=threads, check_hashes=False)
        except ProviderError as exc:
            report.providers[name] = f"not available: {exc}"
            v.add(Check("providers", f"{name} vs cpu", NA, where=f"not available: {exc}"))
            continue
        report.providers[name] = "active"
        provider_vs_cpu(v, cpu_rows, other, name, plan)
    if long:
        say(f"long stream: {long} decode steps vs float64 PyTorch ...")
        report.drift = long_stream(v, cpu, long)
    if manifest.grows and kv:
        say(f"KV cache after {', '.join(f'{n:,}' for n in kv)} tokens vs float64 PyTorch ...")
        kv_cache(v, cpu, kv)
    say("behaviour ...")
    behaviour(v, cpu, k=32)
    routing_agreement(v, cpu)  # a mixture-of-experts model: the graph's chosen experts vs PyTorch's
    say(f"precision ({manifest.precision}) vs fp32 PyTorch: greedy agreement, held-out bits/byte ...")
    text = heldout_text(manifest)
    greedy_agreement(v, cpu, text)
    report.heldout = heldout(v, cpu, text, heldout_bytes)
    v.drop_model64()
    if framework is not None:
        report.upstream = against_upstream(v, cpu, ckpt_path, framework, steps, threads, required=upstream == "required",
                                           dtype=upstream_dtype, note=no_upstream)
    elif no_upstream:
        v.add(Check("upstream", "import and graphs vs the checkpoint's own framework", NA, where=no_upstream))
    report.checks.extend(v.checks)
    report.rounding_floor = {"logits": {"max_rel": v.floor["logits"].max_rel, "rel_l2": v.floor["logits"].rel_l2},
                             "state": {"rel_l2": v.floor["state"].rel_l2}, "factor": parity.FLOOR_FACTOR}
    if v.no_floor:
        report.rounding_floor["not_measured"] = v.no_floor
    if v.peer is not None:
        report.precision_floor = v.peer.record()
    report.seconds = time.perf_counter() - t_start
    return report


def scratch_folder(export_dir: Path, stack: contextlib.ExitStack | None, say: Progress) -> Path | None:
    """A folder for the scratch files of the checkpoint's weights (``edgelin.streaming``: the model's float32 weights
    mapped from disk, not held in memory; the quantised reference's likewise), beside the export (on its disk, not in a
    temporary folder that may be memory), removed when ``stack`` closes; None where none can be made there (the
    weights are then loaded into memory, said)."""
    if stack is None:
        return None
    try:
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix=f".{export_dir.name}.validate-", dir=export_dir.resolve().parent))
    except OSError as exc:
        say(f"no scratch folder beside the export ({exc}): the checkpoint's weights are loaded into memory")
        return None
    return Path(folder)


def _parse_providers(providers: str | list[str]) -> list[str]:
    names = providers.split(",") if isinstance(providers, str) else list(providers)
    names = [n.strip().lower() for n in names if n.strip()]
    if names == ["auto"]:
        return ["cpu", "cuda"]
    bad = [n for n in names if n not in EXECUTION_PROVIDERS]
    if bad or not names:
        raise EdgelinError(f"providers must be a comma list of {', '.join(EXECUTION_PROVIDERS)} (or 'auto'), got {providers!r}")
    return ["cpu"] + [n for n in names if n != "cpu"]
