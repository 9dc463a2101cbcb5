"""Checks 7 and 8: behaviour (greedy continuations, teacher-forced top-1) and precision against fp32 PyTorch (greedy
agreement, bits per byte of held-out text read through the export's tokenizer)."""

from __future__ import annotations

import math

import numpy as np
import torch

from edgelin import parity
from edgelin.runtime.manifest import Manifest
from edgelin.runtime.session import Session
from edgelin.validate.report import FAIL, NA, PASS, Check
from edgelin.validate.validator import Validator, nonfinite_note


# ---- 7. behaviour --------------------------------------------------------------------------
def behaviour(v: Validator, session: Session, k: int) -> None:
    if v.budgets["greedy"]["min_agreement"] >= 1.0:  # exact greedy equality (fp32); else see greedy_agreement
        _greedy_exact(v, session, k)
    _top1(v, session)


def _greedy_exact(v: Validator, session: Session, k: int) -> None:
    prompt = v.ids(1, 24)
    state = session.new_state(1)
    logits = session.prefill(prompt, state)[:, -1]  # [1, V]
    ort_tokens, nonfinite = [], nonfinite_note(logits, "ORT logits after the prompt")
    for i in range(k):
        nonfinite = nonfinite or nonfinite_note(logits, f"ORT logits at greedy step {i}")
        tok = int(logits[0].argmax())
        ort_tokens.append(tok)
        logits = session.decode(np.array([[tok]]), state)[:, -1]
    with torch.no_grad():
        ref, ref_state = v.model(torch.from_numpy(prompt))
        ref = ref[:, -1]
        torch_tokens = []
        for _ in range(k):
            tok = int(ref[0].argmax())
            torch_tokens.append(tok)
            ref, ref_state = v.model.step(torch.tensor([[tok]]), ref_state)
            ref = ref[:, -1]
    first = next((i for i, (a, b) in enumerate(zip(ort_tokens, torch_tokens)) if a != b), None)
    where = nonfinite or ("" if first is None else f"first different token at {first}: ORT {ort_tokens[first]} vs PyTorch {torch_tokens[first]}")
    v.add(Check("behaviour", f"greedy {k} tokens ORT == PyTorch", FAIL if where else PASS, where=where))


def _top1(v: Validator, session: Session) -> None:
    # teacher-forced top-1 agreement over a sequence (informational: near-ties may flip)
    ids = v.ids(2, 200)
    got = session.prefill(ids, session.new_state(2))
    with torch.no_grad():
        want = v.model(torch.from_numpy(ids))[0].numpy()
    agree = parity.agreement(got, want)
    need = v.budgets["top1"]["min_agreement"]
    where = nonfinite_note(got, "ORT logits") or nonfinite_note(want, "PyTorch logits") or ("" if agree >= need else f"agreement {agree:.4f} < {need}")
    v.add(Check("behaviour", f"top-1 agreement {agree * 100:.2f}% (400 positions)", FAIL if where else PASS,
                   budget={"min_agreement": need}, where=where))


# ---- 8. precision: greedy agreement and held-out text (every precision, against fp32 PyTorch) ----
def greedy_agreement(v: Validator, session: Session, text: bytes | None, k: int = 64, prompts: int = 8) -> None:
    """Greedy continuations of ``prompts`` prompts (L tokens of the held-out text, spread over it; random ids
    for a model that reads no text), ORT vs fp32 PyTorch: the mean fraction of the k tokens generated before the
    first difference (a flipped near-tie ends a prompt's run)."""
    need = v.budgets["greedy"]["min_agreement"]
    L = 32
    ids = None if text is None else text_tokens(session, text)[0]
    if ids is not None and len(ids) >= prompts * L:
        step = len(ids) // prompts
        starts = np.stack([ids[i * step : i * step + L] for i in range(prompts)])  # [P, L]
    else:
        starts = v.ids(prompts, L)
    state = session.new_state(prompts)
    logits = session.prefill(starts, state, last_only=True)  # [P, V]
    ort_tokens = np.zeros((prompts, k), dtype=np.int64)
    for t in range(k):
        ort_tokens[:, t] = logits.argmax(-1)
        logits = session.decode(ort_tokens[:, t : t + 1], state)[:, -1]
    torch_tokens = np.zeros((prompts, k), dtype=np.int64)
    with torch.no_grad():
        ref, ref_state = v.model(torch.from_numpy(starts))
        ref = ref[:, -1]
        for t in range(k):
            torch_tokens[:, t] = ref.argmax(-1).numpy()
            ref, ref_state = v.model.step(torch.from_numpy(torch_tokens[:, t : t + 1]), ref_state)
            ref = ref[:, -1]
    same = np.cumprod(ort_tokens == torch_tokens, axis=1).sum(1)  # [P] tokens before the first difference
    agree = float(same.mean() / k)
    ok = agree >= need
    v.add(Check("precision", f"greedy {k} tokens x {prompts} prompts: {agree * 100:.1f}% before the first difference",
                   PASS if ok else FAIL, budget={"min_agreement": need},
                   where="" if ok else f"identical run lengths per prompt {same.tolist()} of {k}"))


def heldout(v: Validator, session: Session, text: bytes | None, max_bytes: int, seq_len: int = 256) -> dict[str, float]:
    """Bits per byte of the export and of fp32 PyTorch on the first ``max_bytes`` of ``text`` as the export's
    tokenizer reads it (windows of seq_len tokens, each from a fresh state, every token after a window's first
    predicted once; the bytes are those the predicted tokens cover) and top-1 agreement over the same positions.
    A byte model reads one token per byte; a Hugging Face tokenizer's tokens cover several."""
    b = v.budgets["heldout"]
    if text is None:
        v.add(Check("precision", "held-out text: bits/byte delta", NA, where="needs a model that reads text (a byte or Hugging Face tokenizer)"))
        return {}
    data, ends = text_tokens(session, text[:max_bytes])
    n = (len(data) - 1) // seq_len
    if n < 1:
        v.add(Check("precision", "held-out text: bits/byte delta", NA, where=f"{len(data)} tokens: fewer than one window of {seq_len + 1}"))
        return {}
    windows = np.stack([data[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])  # [n, seq_len + 1]
    count = int(sum(ends[i * seq_len + seq_len] - ends[i * seq_len] for i in range(n)))  # bytes of the predicted tokens
    nats_ort = nats_ref = 0.0
    agree = 0
    for start in range(0, n, 8):
        w = windows[start : start + 8]
        got = session.prefill(w[:, :-1], session.new_state(len(w))).astype(np.float64)  # [b, seq_len, V]
        with torch.no_grad():
            ref = v.model(torch.from_numpy(w[:, :-1]))[0].double().numpy()
        nats_ort += _nll(got, w[:, 1:])
        nats_ref += _nll(ref, w[:, 1:])
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
    tokens = n * seq_len
    bpb_ort, bpb_ref = nats_ort / count / math.log(2), nats_ref / count / math.log(2)
    delta, top1 = bpb_ort - bpb_ref, agree / tokens
    ok = abs(delta) <= b["max_bpb_delta"] and top1 >= b["min_agreement"]
    what = f"{count} bytes" + ("" if tokens == count else f" ({tokens} tokens)")
    v.add(Check("precision", f"held-out {what}: {bpb_ort:.4f} bits/byte vs {bpb_ref:.4f} (delta {delta:+.4f}), top-1 {top1 * 100:.2f}%",
                   PASS if ok else FAIL, budget=dict(b),
                   where="" if ok else f"bits/byte delta {delta:+.4f}, top-1 agreement {top1:.4f}"))
    return {"bytes": count, "tokens": tokens, "bpb": bpb_ort, "bpb_fp32_torch": bpb_ref, "bpb_delta": delta, "top1": top1}


def _nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed -log p(target) in nats; logits [b, T, V] float64, targets [b, T]."""
    top = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]  # [b, T]
    return float((logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]).sum())


def heldout_text(manifest: Manifest) -> bytes | None:
    """The held-out text of the bundled model's corpus (standard-library modules it never saw in training,
    ``edgelin.models.corpus``), for an export that reads text: a byte tokenizer (256 ids or more) or a Hugging Face
    tokenizer; None where the model reads other tokens."""
    kind = manifest.tokenizer.get("kind")
    if not (kind == "bytes" and manifest.vocab_size >= 256) and kind != "huggingface":
        return None
    from edgelin.models import corpus

    return corpus.heldout_text("code") or None


def text_tokens(session: Session, text: bytes) -> tuple[np.ndarray, np.ndarray]:
    """``text`` as the export's tokenizer reads it, without special tokens: (ids int64 [N], for each token the byte
    offset in ``text`` where it ends [N]). A byte tokenizer: one token per byte (ends 1, 2, ...); a Hugging Face one:
    its ids for the text decoded as UTF-8 (an incomplete character at the end dropped)."""
    spec = session.manifest.tokenizer
    if spec.get("kind") == "bytes":
        ids = np.frombuffer(text, np.uint8).astype(np.int64) + int(spec.get("offset") or 0)
        return ids, np.arange(1, len(ids) + 1, dtype=np.int64)
    string = text.decode("utf-8", errors="ignore")
    encoding = session.tokenizer.tokenizer.encode(string, add_special_tokens=False)
    byte_at = np.concatenate([[0], np.cumsum([len(c.encode("utf-8")) for c in string])])  # character -> byte offset
    return np.asarray(encoding.ids, np.int64), byte_at[[end for _, end in encoding.offsets]].astype(np.int64)
