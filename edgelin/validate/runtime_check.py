"""Check 5 and the providers: the runtime check's comparisons (``edgelin.runtime.golden``) -- the export's golden
outputs on CPU, and every other provider against CPU on this run's inputs."""

from __future__ import annotations

import numpy as np

from edgelin import parity
from edgelin.runtime import golden
from edgelin.runtime.session import Session
from edgelin.validate.report import Check
from edgelin.validate.validator import Validator


# ---- 5. providers --------------------------------------------------------------------------
def provider_vs_cpu(v: Validator, cpu_rows: np.ndarray, other: Session, name: str, plan: golden.Plan) -> None:
    """The runtime check's comparison across providers (``edgelin.runtime.golden``) on this run's inputs."""
    for r in golden.against_provider(golden.run_plan(other, plan), cpu_rows, plan, v.held("provider"), "cpu"):
        v.add(Check.of("providers", f"{name}: {r.name}", r.passed, r.errors, r.budget, r.where))


def golden_outputs(v: Validator, session: Session, gold: golden.Golden) -> None:
    """The export's golden outputs (computed at export) as the runtime check compares them, held to this run's
    logits budget (the export's own bounds and --budget included)."""
    for r in golden.against_golden(golden.run_plan(session, gold.plan), gold, v.held("logits", (gold.floor or parity.NONE).worst(v.floor["logits"]))):
        v.add(Check.of("golden", r.name, r.passed, r.errors, r.budget, r.where))
