"""Checks shared by the importer tests: a stateful model against a framework's logits, and the state carrying
everything (prefill in pieces, token-by-token decode)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from testkit import max_abs


def import_vs_reference(folder: Path, prompt, steps, ref_prefill, ref_decode, budget: float, *, against: str):
    """edgelin's import of ``folder``: a prefill of ``prompt`` [B, T], then each token of ``steps`` [B, n] through
    ``step``, against a framework's logits (``ref_decode[t]``: [B, V] or [B, 1, V]), each within ``budget`` (max
    abs). Returns (model, final state)."""
    from edgelin.checkpoint import load_checkpoint

    assert ref_prefill.std() > 1.0, "logits without spread would hide errors"
    model = load_checkpoint(folder)
    with torch.no_grad():
        logits, state = model(prompt)
        prefill = max_abs(logits, ref_prefill)
        decode = 0.0
        for t in range(steps.shape[1]):
            logits, state = model.step(steps[:, t : t + 1], state)
            decode = max(decode, max_abs(logits, ref_decode[t].reshape(logits.shape)))
    print(f"\n{folder.name}: max abs logits vs {against}: prefill {prefill:.2e}, decode {decode:.2e}")
    assert prefill <= budget, f"prefill: max abs {prefill:.2e} > {budget}"
    assert decode <= budget, f"decode: max abs {decode:.2e} > {budget}"
    return model, state


def export_vs_reference(out: Path, prompt, steps, ref_prefill, ref_decode, budget: float, *, against: str) -> None:
    """The export in ``out`` through edgelin's runtime (ONNX Runtime, CPU, driven from the manifest alone): the
    prefill graph on ``prompt``, then each token of ``steps`` through the decode graph, within ``budget``."""
    from edgelin.runtime import load

    session = load(out, provider="cpu")
    state = session.new_state(prompt.shape[0])
    prefill = max_abs(torch.from_numpy(session.prefill(prompt.numpy(), state)), ref_prefill)
    decode = 0.0
    for t in range(steps.shape[1]):
        logits = torch.from_numpy(session.decode(steps[:, t : t + 1].numpy(), state))
        decode = max(decode, max_abs(logits, ref_decode[t].reshape(logits.shape)))
    print(f"\n{out.name} (ONNX): max abs logits vs {against}: prefill {prefill:.2e}, decode {decode:.2e}")
    assert prefill <= budget, f"prefill graph: max abs {prefill:.2e} > {budget}"
    assert decode <= budget, f"decode graph: max abs {decode:.2e} > {budget}"


def fused_export_vs_reference(folder: Path, out: Path, prompt, steps, ref_prefill, ref_decode, budget: float, *, against: str) -> None:
    """``edgelin export --ops fused`` of ``folder``: one LinearAttention node per recurrent layer (neither softmax
    attention nor a short-conv layer) and one CausalConvWithState node per short conv, in both graphs; then both
    graphs against a framework's logits as ``export_vs_reference``."""
    import onnx

    from edgelin.checkpoint import load_checkpoint
    from edgelin.layers.linear_attention import ShortConv
    from edgelin.exporters import export
    from edgelin.layers.short_conv import WindowConv

    export(folder, out, check=False, ops="fused")
    model = load_checkpoint(folder)
    layers = sum(block.attn.kind not in ("attention", "short_conv") for block in model.blocks)
    convs = sum(isinstance(m, (WindowConv, ShortConv)) for m in model.modules())
    for graph in ("prefill", "decode"):
        ops = [n.op_type for n in onnx.load(str(out / f"{graph}.onnx"), load_external_data=False).graph.node]
        assert ops.count("LinearAttention") == layers, (graph, ops.count("LinearAttention"), layers)
        assert ops.count("CausalConvWithState") == convs, (graph, ops.count("CausalConvWithState"), convs)
    export_vs_reference(out, prompt, steps, ref_prefill, ref_decode, budget, against=against)


def pieces_and_steps_agree(model, ids: torch.Tensor, pieces: tuple[int, ...], *, tol: float = 2e-5, state_tol: float = 1e-5) -> None:
    """The state carries everything: prefilling ``ids`` in ``pieces`` (their sum is the length) from a carried
    state, and the step form token by token from a fresh state, both give one prefill's logits and state."""
    assert sum(pieces) == ids.shape[1]
    with torch.no_grad():
        ref, ref_state = model(ids)
        parts, state, start = [], None, 0
        for n in pieces:
            logits, state = model(ids[:, start : start + n], state)
            parts.append(logits)
            start += n
        steps, stepped = [], model.init_state(ids.shape[0])
        for t in range(ids.shape[1]):
            logits, stepped = model.step(ids[:, t : t + 1], stepped)
            steps.append(logits)
    for got, got_state in ((torch.cat(parts, 1), state), (torch.cat(steps, 1), stepped)):
        assert max_abs(got, ref) <= tol
        for key, value in ref_state.items():
            assert got_state[key].dtype == value.dtype, key
            assert torch.allclose(got_state[key], value, rtol=state_tol, atol=state_tol), key


def protocol_and_naive_agree(model, family: str, ids: torch.Tensor, tol: float = 1e-10) -> None:
    """``model`` follows the model protocol, names ``family`` in a JSON-able config, and its naive forms (every
    mixer's slow reference) give the chunk form's logits and state in float64 within ``tol``. Leaves the model in
    float32."""
    from edgelin.protocol import ExportableModel, check_model

    assert isinstance(model, ExportableModel)
    check_model(model)
    assert model.model_config()["family"] == family
    json.dumps(model.model_config())
    with torch.no_grad():
        m64 = model.double()
        ref, ref_state = m64(ids, form="naive")
        logits, state = m64(ids)
        assert max_abs(logits, ref) <= tol
        for key, value in ref_state.items():
            assert max_abs(state[key], value) <= tol, key
    model.float()


def edited_copy(folder: Path, out: Path, **changes) -> Path:
    """A copy of checkpoint ``folder`` at ``out`` with ``changes`` made to its config.json."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    shutil.copy(folder / "model.safetensors", out / "model.safetensors")
    return out


__all__ = ["edited_copy", "export_vs_reference", "import_vs_reference", "pieces_and_steps_agree", "protocol_and_naive_agree"]
