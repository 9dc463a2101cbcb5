"""The generalised delta rule's (DPLR, RWKV-7) accuracy table: the chunk and recurrent forms against the float64
naive loop, printed as markdown.

Rank-one parts: RWKV-7's (a = -kk, b = kk * lr, kk a unit vector, lr in (0, 1) per channel) and a random one (a, b
independent directions of norm 0.5). Decays: "none" is w = 0 (the state lives longest), "mild" is RWKV-7's range
(w = -exp(-0.5) sigmoid(x), in (-0.61, 0)), "strong" has ~20 % of the entries at -30, ~20 % at -1e-6 and the rest
-exp(2x) clipped to [-30, 0]. q Gaussian, k Gaussian / sqrt(K), v Gaussian, from a carried initial state, batch 2.
Each cell: the largest relative error max|fast - naive| / max|naive| of the outputs / of the final state, in
float64 and float32 (inputs rounded to float32 first, compared with the float64 result on the float64 inputs).
docs/DESIGN.md ("The generalised delta rule (RWKV-7)") quotes the table.

    python scripts/dplr_accuracy.py [--dim 64] [--heads 2] [--chunk 16] [--lengths 1,15,16,17,1000,4000]

``--timing`` prints instead the ONNX Runtime times (one thread) of the exported forms of one layer's recurrence
(batch 1, --heads heads of K = V = --dim): the decode graph (``dplr_step``) per token, and the prefill graph
(``chunk_dplr``, bounded to 4096 tokens) at T = 1000 and 4000 for chunk sizes 8, 16, 32 and 64 with its relative error
against the float64 naive loop (RWKV-7's rank-one part, strong decays, a random initial state).

``--fla-kernel`` prints instead the naive and chunk forms (float64) against fla's own RWKV-7 recurrence kernel
(``fused_mul_recurrent_rwkv7``, float32, in Triton's interpreter on CPU) with RWKV-7's arguments: a = -kk,
b = kk * a_lr, w = -exp(-0.5) sigmoid(x), scale 1, a random initial state; fla's layout [B, T, H, D] converted.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from edgelin.ops.delta import sequence_bound
from edgelin.ops.dplr import DEFAULT_CHUNK, DPLR_FORMS, chunk_dplr, dplr_step


def inputs(B: int, H: int, T: int, D: int, kind: str, decays: str, seed: int):
    """q, k, v, a, b, w, float64 [B, H, T, D]."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda: torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)  # noqa: E731
    rand = lambda: torch.rand(B, H, T, D, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = randn(), randn() * D**-0.5, randn()
    if kind == "rwkv7":
        kk = F.normalize(randn(), dim=-1)
        a, b = -kk, kk * rand()
    else:
        a, b = 0.5 * F.normalize(randn(), dim=-1), 0.5 * F.normalize(randn(), dim=-1)
    if decays == "none":
        w = torch.zeros(B, H, T, D, dtype=torch.float64)
    elif decays == "mild":
        w = -torch.exp(torch.tensor(-0.5, dtype=torch.float64)) * torch.sigmoid(2 * randn())
    else:
        r = rand()
        w = torch.where(r < 0.2, -30.0, torch.where(r > 0.8, -1e-6, -torch.exp(2 * randn()).clamp_max(30.0)))
    return q, k, v, a, b, w


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


class _Prefill(torch.nn.Module):
    def __init__(self, chunk: int):
        super().__init__()
        self.chunk = chunk

    def forward(self, q, k, v, a, b, w, S):
        o, state = chunk_dplr(q, k, v, a, b, w, initial_state={"S": S}, chunk_size=self.chunk)
        return o, state["S"]


class _Decode(torch.nn.Module):
    def forward(self, q, k, v, a, b, w, S):
        o, state = dplr_step(q, k, v, a, b, w, initial_state={"S": S})
        return o, state["S"]


def timing(H: int, D: int) -> None:
    """Median ONNX Runtime times (one thread) of the decode graph per token and the prefill graph per call."""
    import onnxruntime as ort

    from edgelin.exporters.exporter import export_graph

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    names = (["q", "k", "v", "a", "b", "w", "S"], ["o", "S_out"])
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1

    def feeds(T: int) -> dict:
        x = inputs(1, H, T, D, "rwkv7", "strong", seed=T)
        S = torch.randn(1, H, D, D, generator=torch.Generator().manual_seed(T))
        return dict(zip(names[0], (t.float().numpy() for t in (*x, S))))

    def median_ms(session, feed, repeats: int) -> float:
        session.run(None, feed)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            session.run(None, feed)
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    seq = torch.export.Dim("sequence", min=1, max=1 << 24)
    print(f"ONNX Runtime {ort.__version__}, one thread, batch 1, H={H}, K=V={D}: median ms")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "decode.onnx"
        example = tuple(torch.from_numpy(a) for a in feeds(1).values())
        export_graph(_Decode().eval(), example, names, None, 20, path)
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        print(f"decode (dplr_step): {median_ms(session, feeds(1), 2000):.4f} ms/token")
        for chunk in (8, 16, 32, 64):
            path = Path(tmp) / f"prefill{chunk}.onnx"
            example = tuple(torch.from_numpy(a) for a in feeds(2 * chunk + 3).values())
            with sequence_bound(4096):
                export_graph(_Prefill(chunk).eval(), example, names, ({2: seq},) * 6 + (None,), 20, path)
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            cells = []
            for T in (1000, 4000):
                feed = feeds(T)
                o, S = session.run(None, feed)
                x = [torch.from_numpy(a).double() for a in feed.values()]
                ref_o, ref_S = DPLR_FORMS["naive"](*x[:6], initial_state={"S": x[6]})
                err = max(rel(torch.from_numpy(o), ref_o), rel(torch.from_numpy(S), ref_S["S"]))
                cells.append(f"T={T}: {median_ms(session, feed, 5):.1f} ms (relative error vs float64 naive {err:.1e})")
            print(f"prefill (chunk_dplr) C={chunk}: " + ", ".join(cells))


def fla_kernel() -> None:
    """Max abs difference of o and of the final S between fla's RWKV-7 kernel and the naive and chunk forms."""
    import warnings

    os.environ["TRITON_INTERPRET"] = "1"  # before fla defines its kernels
    warnings.filterwarnings("ignore", message=".*Triton is not supported on current platform.*")
    import fla.models  # noqa: F401  (fla.ops needs triton; its kernels are defined on import)

    from edgelin.upstream_run import interpret_on_cpu

    interpret_on_cpu()
    from fla.ops.rwkv7 import fused_mul_recurrent_rwkv7

    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 2, 40, 2, 16, 16
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    r, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    kk = F.normalize(randn(B, T, H, K), dim=-1)
    a_lr = torch.rand(B, T, H, K, generator=gen)
    w = -0.6065306597126334 * torch.sigmoid(2 * randn(B, T, H, K))
    S0 = randn(B, H, K, V)
    o, S = fused_mul_recurrent_rwkv7(r, w, k, v, kk, a_lr, scale=1.0, initial_state=S0, output_final_state=True)
    t = lambda x: x.transpose(1, 2).double()  # noqa: E731  [B, T, H, D] -> [B, H, T, D]
    sizes = f"B={B} T={T} H={H} K={K} V={V}"
    print(f"fla fused_mul_recurrent_rwkv7 (float32) vs edgelin (float64), {sizes}; max |o| {o.abs().max():.1f}")
    for form in ("naive", "chunk"):
        eo, es = DPLR_FORMS[form](t(r), t(k), t(v), -t(kk), t(kk) * t(a_lr), t(w), initial_state={"S": S0.double()})
        print(f"{form}: max abs o {(t(o) - eo).abs().max():.1e}, S {(S.double() - es['S']).abs().max():.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=64, help="head width K = V")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK)
    parser.add_argument("--lengths", default="1,15,16,17,1000,4000")
    parser.add_argument("--forms", default="chunk,recurrent")
    parser.add_argument("--timing", action="store_true", help="time the exported graphs in ONNX Runtime instead")
    parser.add_argument("--fla-kernel", action="store_true", help="compare with fla's RWKV-7 kernel instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.fla_kernel:
        fla_kernel()
        return
    if args.timing:
        timing(args.heads, args.dim)
        return
    lengths = [int(t) for t in args.lengths.split(",")]
    forms = args.forms.split(",")
    B, H, D, C = 2, args.heads, args.dim, args.chunk
    print(f"B={B} H={H} K=V={D} C={C}; cells: max relative error of o / of the final S vs the float64 naive loop\n")
    print("| form | dtype | rank one | decay | " + " | ".join(f"T={t}" for t in lengths) + " |")
    print("|---|---|---|---|" + "---|" * len(lengths))
    worst: dict[tuple, list[float]] = {}
    finite = True
    for kind in ("rwkv7", "random"):
        for decays in ("none", "mild", "strong"):
            cells: dict[tuple, list] = {}
            for T in lengths:
                _, S0 = DPLR_FORMS["naive"](*inputs(B, H, 7, D, kind, decays, seed=1))  # a carried state
                x = inputs(B, H, T, D, kind, decays, seed=2 + T)
                ref_o, ref_S = DPLR_FORMS["naive"](*x, initial_state=S0)
                for form in forms:
                    for dtype in (torch.float64, torch.float32):
                        o, S = DPLR_FORMS[form](*(t.to(dtype) for t in x), initial_state={"S": S0["S"].to(dtype)}, chunk_size=C)
                        finite &= bool(torch.isfinite(o).all() and torch.isfinite(S["S"]).all())
                        e = (rel(o, ref_o), rel(S["S"], ref_S["S"]))
                        cells.setdefault((form, dtype), []).append(e)
                        w = worst.setdefault((form, dtype), [0.0, 0.0])
                        w[0], w[1] = max(w[0], e[0]), max(w[1], e[1])
            for (form, dtype), errs in cells.items():
                name = str(dtype).replace("torch.", "")
                print(f"| {form} | {name} | {kind} | {decays} | " + " | ".join(f"{o:.1e} / {s:.1e}" for o, s in errs) + " |")
    print("\nworst:", ", ".join(f"{f} {str(d).replace('torch.', '')}: o {o:.1e}, S {s:.1e}" for (f, d), (o, s) in worst.items()))
    print("every output and state finite:", finite)


if __name__ == "__main__":
    main()
