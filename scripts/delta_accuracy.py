"""The delta rule's accuracy table: every fast form against the float64 naive reference.

For DeltaNet (no gate) and Gated DeltaNet (g per head per step, down to -20), beta in four regimes (near 0,
uniform in (0, 1), near 1, and in (1, 2): negative eigenvalues), from a carried initial state, batch 2: the
largest relative error max|fast - naive| / max|naive| over the outputs and over the final state, in float64
and float32 (inputs rounded to float32 first, then compared with the float64 result on the float64 inputs).
docs/DESIGN.md ("The delta rule") quotes the table.

    python scripts/delta_accuracy.py [--dim 64] [--chunk 64] [--lengths 1,63,64,65,500,2000]
"""

from __future__ import annotations

import argparse
import torch
import torch.nn.functional as F

from edgelin.ops.delta import DELTA_FORMS, l2norm

BETAS = ("near0", "uniform", "near1", "neg")


def inputs(B: int, H: int, T: int, D: int, kind: str, betas: str, seed: int):
    """q, k (unit), v, beta, g (or None), float64."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)) for _ in range(2))
    v = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
    u = torch.rand(B, H, T, generator=gen, dtype=torch.float64)
    beta = {"near0": 1e-3 * u, "uniform": u, "near1": 1 - 1e-3 * u, "neg": 1 + u}[betas]
    g = None
    if kind == "gated":  # logsigmoid of a spread of inputs, with ~10 % of the steps at -20 (forget) and ~20 % at ~0 (keep)
        g = F.logsigmoid(torch.randn(B, H, T, generator=gen, dtype=torch.float64) * 2 + 1)
        r = torch.rand(B, H, T, generator=gen, dtype=torch.float64)
        g = torch.where(r < 0.1, -20.0, torch.where(r > 0.8, -1e-6, g))
    return q, k, v, beta, g


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=64, help="head width K = V")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--lengths", default="1,63,64,65,500,2000")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths = [int(t) for t in args.lengths.split(",")]
    B, H, D, C = 2, args.heads, args.dim, args.chunk
    print(f"B={B} H={H} K=V={D} C={C}; cells: max relative error of o / of the final S vs float64 naive")
    print(f"{'form':10} {'dtype':8} {'rule':6} {'beta':8} " + " ".join(f"{'T=' + str(t):>19}" for t in lengths))
    worst: dict[tuple, list[float]] = {}
    for kind in ("delta", "gated"):
        for betas in BETAS:
            cells = {}
            for T in lengths:
                q0, k0, v0, b0, g0 = inputs(B, H, 7, D, kind, betas, seed=1)
                _, S0 = DELTA_FORMS["naive"](q0, k0, v0, b0, g=g0)  # a carried state
                q, k, v, beta, g = inputs(B, H, T, D, kind, betas, seed=2 + T)
                ref_o, ref_S = DELTA_FORMS["naive"](q, k, v, beta, g=g, initial_state=S0)
                for form in ("chunk", "recurrent"):
                    for dtype in (torch.float64, torch.float32):
                        cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
                        o, S = DELTA_FORMS[form](
                            cast(q), cast(k), cast(v), cast(beta), g=cast(g), initial_state={"S": cast(S0["S"])}, chunk_size=C
                        )
                        e = (rel(o, ref_o), rel(S["S"], ref_S["S"]))
                        cells.setdefault((form, dtype), []).append(e)
                        w = worst.setdefault((form, dtype), [0.0, 0.0])
                        w[0], w[1] = max(w[0], e[0]), max(w[1], e[1])
            for (form, dtype), errs in cells.items():
                name = str(dtype).replace("torch.", "")
                row = " ".join(f"{o:9.1e} / {s:7.1e}" for o, s in errs)
                print(f"{form:10} {name:8} {kind:6} {betas:8} {row}")
    print("worst:", ", ".join(f"{f} {str(d).replace('torch.', '')}: o {o:.1e}, S {s:.1e}" for (f, d), (o, s) in worst.items()))


if __name__ == "__main__":
    main()
