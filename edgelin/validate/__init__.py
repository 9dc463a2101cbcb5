"""Parity: is an export the model it claims to be? PyTorch vs ONNX Runtime, prefill vs decode, across providers.

``validate(export_dir, checkpoint)`` runs every check, collects every failure (not just the first) and
returns a ``Report``: one ``Check`` per comparison with its numbers, the budget it was held to, a verdict,
and on failure where it diverged first (step, layer, state). ``edgelin validate`` prints it as a table.

Checks, in order:
 1. structure   manifest <-> graphs (names, dtypes, ranks, symbolic dims); metadata == sidecar; weights hash
 2. prefill     prefill graph vs PyTorch forward: logits and every final state, several T, batch > 1
 3. decode      decode graph vs PyTorch step, N steps, each side feeding back its own state
 4. graphs      prefill over T tokens == T decode steps; prefill continued from a state == one prefill
 5. golden      the export's golden outputs (golden.json, computed at export) on CPU, as `edgelin check` compares them
    providers   every requested provider vs CPU, prefill in pieces + multi-step decode (the runtime check's
                comparison, edgelin.runtime.golden, on this run's inputs); an inactive one is "n/a"
 6. long        N decode steps vs a float64 PyTorch run: drift curve, non-finite values
 7. behaviour   greedy continuation ORT vs PyTorch; top-1 agreement under teacher forcing
 8. upstream    for a foreign checkpoint, the framework it came from (transformers, fla) running its own model on
                the same ids (edgelin.upstream, in a subprocess): edgelin's import vs it and the graphs vs it --
                prefill logits, cached decode logits, greedy ids; a departing import names its first layer

An int8 or int4 export's states (checks 2, 3 and the KV-cache check) are held to PyTorch computing the export's own
quantisation (edgelin.quantref: the dequantised weights, the activations rounded as ONNX Runtime rounds them), its
logits to fp32 PyTorch: the first says the graphs compute that quantisation, the second how far it moves the model.

The package: one module per group (``structure``, ``prefill_decode``, ``runtime_check``: golden and providers,
``long``: long stream and KV cache, ``behaviour``: behaviour and precision, ``upstream_checks``), what they share
(``validator``), the report (``report``) and ``validate`` itself (``run``). Import from this package.
"""

from __future__ import annotations

from edgelin.parity import BUDGETS
from edgelin.validate.behaviour import heldout_text, text_tokens
from edgelin.validate.report import FAIL, NA, PASS, REPORT_FILE, REPORT_FORMAT, Check, Report
from edgelin.validate.run import KV_LENGTHS, budgets_for, validate
from edgelin.validate.structure import check_structure

__all__ = ["BUDGETS", "Check", "FAIL", "KV_LENGTHS", "NA", "PASS", "REPORT_FILE", "REPORT_FORMAT", "Report", "budgets_for", "check_structure",
           "heldout_text", "text_tokens", "validate"]
