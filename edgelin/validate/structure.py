"""Check 1: the export's structure -- manifest <-> graphs, the files' hashes, the source weights and config -- and
whether the checkpoint's model is the export's model at all."""

from __future__ import annotations

from pathlib import Path

from edgelin.checkpoint import weights_sha256
from edgelin.errors import EdgelinError, ManifestError
from edgelin.runtime.check import check_graph
from edgelin.runtime.manifest import Manifest, join_problems
from edgelin.runtime.providers import open_session
from edgelin.validate.report import FAIL, NA, PASS, Check


def check_structure(export_dir: Path, manifest: Manifest, checkpoint: Path | None, model) -> list[Check]:
    """Manifest <-> graphs (the runtime's check_graph, with the embedded manifest compared by content),
    source hash <-> checkpoint, config <-> manifest, graph files <-> the manifest's sha256. Every problem is listed."""
    checks = []
    if manifest.sha256 is None:
        checks.append(Check("structure", "graph files <-> edgelin.json sha256", NA, where="an edgelin/1 manifest has no graph hashes"))
    else:
        problems = manifest.file_problems(export_dir)
        checks.append(Check("structure", "graph files <-> edgelin.json sha256", FAIL if problems else PASS, where=join_problems(problems)))
    for graph, fname in manifest.graphs.items():
        try:
            sess = open_session(export_dir / fname, "cpu", optimization="disable")
        except ManifestError as exc:
            checks.append(Check("structure", f"{graph} graph", FAIL, where=str(exc)))
            continue
        problems = check_graph(graph, fname, sess, manifest, metadata="content")
        checks.append(Check("structure", f"{graph} graph <-> manifest", FAIL if problems else PASS, where="; ".join(problems)))

    if checkpoint is not None and model is not None:
        problems = []
        digest = weights_sha256(checkpoint)
        if digest != manifest.source:
            problems.append(f"weights sha256 {digest[:12]}... != manifest source {manifest.source[:12]}...")
        cfg = model.model_config()
        diff = sorted(k for k in set(cfg) | set(manifest.model) if k != "chunk_size" and manifest.model.get(k) != cfg.get(k))
        if diff:
            problems.append(f"config differs in {', '.join(diff)}")
        checks.append(Check("structure", "source weights + config", FAIL if problems else PASS, where="; ".join(problems)))
    return checks


def contract_mismatch(model, manifest: Manifest) -> str:
    """What makes ``model`` another model than the export's, so that no output can be compared: its vocabulary
    or its state contract (names and shapes; not dtypes, which an export may store in float16); "" when they agree."""
    if model.vocab_size != manifest.vocab_size:
        return f"the checkpoint's model has a vocabulary of {model.vocab_size:,}, the export {manifest.vocab_size:,}"
    theirs = {s.input: (s.output, tuple(s.shape)) for s in model.state_specs()}
    ours = {s.input: (s.output, tuple(s.shape)) for s in manifest.states}
    if theirs != ours:
        name = (sorted(set(theirs) ^ set(ours)) or sorted(k for k in ours if theirs[k] != ours[k]))[0]

        def said(states):
            return str(list(states[name][1])) if name in states else "none"

        return f"the checkpoint's model and the export differ in their state {name} (checkpoint: {said(theirs)}; export: {said(ours)})"
    return ""


def resolve_checkpoint(manifest: Manifest, checkpoint: str | Path | None) -> Path:
    if checkpoint is not None:
        return Path(checkpoint)
    from edgelin.models import bundled_checkpoint

    bundled = bundled_checkpoint()
    if bundled is not None and weights_sha256(bundled) == manifest.source:
        return bundled
    raise EdgelinError("this export is not of the bundled model: pass --checkpoint with the checkpoint it was exported from")
