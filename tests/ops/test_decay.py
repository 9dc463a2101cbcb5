"""Linear attention with a per-step log-decay g: every fast form against the naive reference.

Gates (H = 4 heads):
- "fixed":   RetNet, g = log(gamma_h) broadcast over time, gamma_h = 0.5, 1 - 2^-5, 1 - 2^-9, 0.9999;
- "scalar":  a data-dependent [B, H, T] gate, logsigmoid of random inputs;
- "feature": a data-dependent [B, H, T, F] gate (GLA), logsigmoid of random inputs.
The data-dependent gates put ~10 % of the steps at g ~ -30 (gate ~ 0: forget) and ~20 % at g ~ -1e-6
(gate ~ 1: keep), so the chunked form sees both extremes inside one chunk.

The reference is always the naive form in float64 on the same (float64-cast) inputs, so a float32 run is
measured against the true value. The long length (T = 500) runs with batch 1, from a carried state and
for three maps only, to keep the suite at seconds: the naive reference loops over T, and the parallel
form's per-feature decay tensor is [B, H, T, T, F].
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from edgelin.ops import FORMS, SEQUENCE_FORMS, chunk_linear_attention, recurrent_linear_attention, recurrent_step
from testkit.covering import covering, ident
from testkit.linear import D, DTYPE_LABEL, DTYPES, N_FEATURES, PREFIX, TOLERANCE, cast_state, check_against, feature_map
from testkit.linear import random_qkv as _random_qkv

C = 16  # chunk size
H = 4  # heads
GAMMAS = (0.5, 1 - 2**-5, 1 - 2**-9, 0.9999)  # one per head
LONG = 500
LENGTHS = (1, C - 1, C, C + 1, 3 * C + 5, LONG)
FAST_FORMS = ("chunk", "recurrent", "parallel")
GATES = ("fixed", "scalar", "feature")
# (feature map, normalize): the signed identity map without the denominator (GLA, RetNet), positive maps
# with and without it, random features (F != D) and a position-carrying map.
MAPS = (
    ("identity", False),
    ("elu+1", True),
    ("elu+1", False),
    ("relu", True),
    ("performer", True),
    ("cosformer", True),
)
LONG_MAPS = (("identity", False), ("elu+1", True), ("performer", True))


def make_gate(kind: str, B: int, T: int, width: int, seed: int) -> torch.Tensor:
    """A log-decay of the given kind, float64: [B, H, T] or [B, H, T, width]."""
    if kind == "fixed":
        log_gamma = torch.tensor(GAMMAS, dtype=torch.float64).log()  # [H]
        return log_gamma[None, :, None].expand(B, H, T).clone()  # [B, H, T]
    gen = torch.Generator().manual_seed(seed)
    shape = (B, H, T, width) if kind == "feature" else (B, H, T)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 1
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    x = torch.where(u < 0.1, torch.full_like(x, -30.0), x)  # gate ~ 0: g ~ -30
    x = torch.where(u > 0.8, torch.full_like(x, 14.0), x)  # gate ~ 1: g ~ -8e-7
    return F.logsigmoid(x)


def random_qkv(B: int, T: int, seed: int):
    return _random_qkv(B, H, T, seed)


@functools.lru_cache(maxsize=None)
def reference(name: str, normalize: bool, kind: str, T: int, B: int, with_state: bool):
    """(q, k, v, g, initial_state, o, final_state), float64, from the naive form. Callers must not mutate."""
    fm = feature_map(name)
    initial = None
    if with_state:
        seed = 1000 + 10 * T + B
        prefix = random_qkv(B, PREFIX, seed)
        g0 = make_gate(kind, B, PREFIX, fm.out_dim, seed)
        _, initial = FORMS["naive"](*prefix, feature_map=fm, normalize=normalize, g=g0)
    q, k, v = random_qkv(B, T, seed=10 * T + B)
    g = make_gate(kind, B, T, fm.out_dim, seed=10 * T + B + 1)
    o, final = FORMS["naive"](q, k, v, feature_map=fm, initial_state=initial, normalize=normalize, g=g)
    return q, k, v, g, initial, o, final


# The grid: every value of every axis and every pair of axes; in full: every form with every gate at every
# length from a fresh and a carried state, with every map and in both dtypes, and every gate at every length
# in both dtypes. The long length runs with batch 1, from a carried state and for three maps only, to keep
# the suite at seconds: the naive reference loops over T, and the parallel form's per-feature decay tensor is
# [B, H, T, T, F].
AXES = {
    "form": FAST_FORMS, "kind": GATES, "map": MAPS, "T": LENGTHS, "B": (1, 3), "with_state": (False, True), "dtype": DTYPES,
}
FULL = (("form", "kind", "T", "with_state"), ("form", "kind", "map"), ("form", "kind", "dtype"), ("kind", "T", "dtype"))


def allowed(row) -> bool:
    return row["T"] != LONG or (row["map"] in LONG_MAPS and row["B"] == 1 and row["with_state"])


LABELS = {
    "map": lambda m: f"{m[0]}-{'den' if m[1] else 'noden'}", "T": lambda t: f"T{t}", "B": lambda b: f"B{b}",
    "with_state": lambda w: "state" if w else "fresh", "dtype": DTYPE_LABEL.get,
}
GRID = covering(AXES, full=FULL, allowed=allowed)


@pytest.mark.parametrize(
    "form, kind, name, normalize, T, B, with_state, dtype",
    [pytest.param(r["form"], r["kind"], *r["map"], *list(r.values())[3:], id=ident(r, LABELS)) for r in GRID],
)
def test_fast_form_matches_naive(form, kind, name, normalize, T, B, with_state, dtype):
    q, k, v, g, initial, ref_o, ref_state = reference(name, normalize, kind, T, B, with_state)
    o, state = FORMS[form](
        q.to(dtype), k.to(dtype), v.to(dtype), feature_map=feature_map(name), g=g.to(dtype),
        initial_state=cast_state(initial, dtype), chunk_size=C, normalize=normalize,
    )
    check_against(o, state, ref_o, ref_state, dtype)


@pytest.mark.parametrize("chunk_size", [1, 5, 37, 64], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("kind", GATES)
def test_chunk_form_any_chunk_size(kind, chunk_size):
    """T=53 against chunk sizes 1 (one chunk per token), 5 (does not divide it), 37 and 64 (exceeds it)."""
    q, k, v, g, initial, ref_o, ref_state = reference("elu+1", True, kind, 3 * C + 5, 3, True)
    o, state = chunk_linear_attention(
        q, k, v, feature_map=feature_map("elu+1"), g=g, initial_state=initial, chunk_size=chunk_size
    )
    check_against(o, state, ref_o, ref_state, torch.float64, TOLERANCE[torch.float64])


@pytest.mark.parametrize("name, normalize", MAPS, ids=[f"{n}-{'den' if z else 'noden'}" for n, z in MAPS])
@pytest.mark.parametrize("kind", GATES)
def test_chunk_state_carried_across_calls(kind, name, normalize):
    """chunk(a) then chunk(b, its state) == chunk(a + b), outputs and state; cuts inside a chunk."""
    fm = feature_map(name)
    q, k, v = random_qkv(2, 3 * C + 5, seed=11)
    g = make_gate(kind, 2, 3 * C + 5, fm.out_dim, seed=12)
    o, state = chunk_linear_attention(q, k, v, feature_map=fm, g=g, chunk_size=C, normalize=normalize)
    cut = C + 5
    first = {"feature_map": fm, "chunk_size": C, "normalize": normalize}
    o1, s1 = chunk_linear_attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], g=g[:, :, :cut], **first)
    o2, s2 = chunk_linear_attention(
        q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], g=g[:, :, cut:], initial_state=s1, **first
    )
    check_against(torch.cat([o1, o2], dim=2), s2, o, state, torch.float64, TOLERANCE[torch.float64])


@pytest.mark.parametrize("kind", GATES)
def test_recurrent_step_loop_is_recurrent(kind):
    """recurrent_step token by token, g sliced per step, gives the recurrent form bit for bit."""
    fm = feature_map("performer")
    q, k, v, g, initial, _, _ = reference("performer", True, kind, C + 1, 3, True)
    o_all, s_all = recurrent_linear_attention(q, k, v, feature_map=fm, g=g, initial_state=initial)
    state, outs = initial, []
    for t in range(q.shape[2]):
        step = slice(t, t + 1)
        o, state = recurrent_step(q[:, :, step], k[:, :, step], v[:, :, step], feature_map=fm, g=g[:, :, step], initial_state=state)
        outs.append(o)
    assert torch.equal(torch.cat(outs, dim=2), o_all)
    assert all(torch.equal(state[key], s_all[key]) for key in s_all)


@pytest.mark.parametrize("form", SEQUENCE_FORMS)
@pytest.mark.parametrize("per_feature", [False, True], ids=["head", "feature"])
def test_zero_decay_is_no_decay(form, per_feature):
    """g = 0 (gate 1) through the decayed code gives the undecayed form's result."""
    fm = feature_map("cosformer")
    q, k, v = random_qkv(3, 3 * C + 5, seed=5)
    shape = (3, H, 3 * C + 5, fm.out_dim) if per_feature else (3, H, 3 * C + 5)
    _, initial = FORMS["naive"](*random_qkv(3, PREFIX, seed=6), feature_map=fm)
    o, state = FORMS[form](q, k, v, feature_map=fm, initial_state=initial, chunk_size=C)
    o0, state0 = FORMS[form](q, k, v, feature_map=fm, initial_state=initial, chunk_size=C, g=torch.zeros(shape, dtype=q.dtype))
    check_against(o0, state0, o, state, torch.float64, TOLERANCE[torch.float64])


def _aten_ops(fn, *args, **kwargs) -> collections.Counter:
    class Wrap(torch.nn.Module):
        def forward(self, *a):
            o, state = fn(*a, **kwargs)
            return o, state["S"], state["z"]

    program = torch.export.export(Wrap(), args)
    return collections.Counter(str(node.target) for node in program.graph.nodes if node.op == "call_function")


def test_no_decay_adds_no_ops():
    """g absent: the chunk (prefill) and step (decode) graphs carry no exp and only the undecayed cumsums."""
    fm = feature_map("identity")
    q, k, v = (torch.randn(2, H, 2 * C + 3, D) for _ in range(3))
    chunk_ops = _aten_ops(chunk_linear_attention, q, k, v, feature_map=fm, chunk_size=C)
    assert chunk_ops["aten.exp.default"] == 0 and chunk_ops["aten.cumsum.default"] == 2, chunk_ops
    step_ops = _aten_ops(recurrent_step, q[:, :, :1], k[:, :, :1], v[:, :, :1], feature_map=fm)
    assert step_ops["aten.exp.default"] == 0, step_ops
    decayed = _aten_ops(recurrent_step, q[:, :, :1], k[:, :, :1], v[:, :, :1], feature_map=fm, g=torch.full((2, H, 1), -0.1))
    assert decayed["aten.exp.default"] == 1, decayed


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("pattern", ["all", "alternate"])
@pytest.mark.parametrize("per_feature", [False, True], ids=["head", "feature"])
@pytest.mark.parametrize("form", SEQUENCE_FORMS)
def test_extreme_decay_stays_finite(form, per_feature, pattern, dtype):
    """g = -1e4 (a chunk's total is -6.4e5 at C = 64): nothing overflows or turns NaN.

    "all": every step forgets everything before it, so o_t = phi(q_t)^T phi(k_t) v_t / (phi(q_t)^T phi(k_t) + eps)
    exactly, a closed form independent of every form. "alternate": -1e4 and 0 alternate, against the naive form.
    """
    fm = feature_map("elu+1")
    B, T = 2, 150
    q, k, v = random_qkv(B, T, seed=21)
    g = torch.full((B, H, T, D) if per_feature else (B, H, T), -1e4, dtype=torch.float64)
    if pattern == "alternate":
        g[:, :, ::2] = 0.0
    _, initial = FORMS["naive"](*random_qkv(B, PREFIX, seed=22), feature_map=fm)
    o, state = FORMS[form](
        q.to(dtype), k.to(dtype), v.to(dtype), feature_map=fm, g=g.to(dtype), initial_state=cast_state(initial, dtype), chunk_size=64
    )
    if pattern == "all":
        fq, fk = fm(q, is_query=True), fm(k, is_query=False)  # [B, H, T, F]
        sim = (fq * fk).sum(-1, keepdim=True)  # [B, H, T, 1]
        ref_o = sim * v / (sim + 1e-6)  # [B, H, T, D]
        ref_state = {"S": fk[:, :, -1, :, None] * v[:, :, -1, None, :], "z": fk[:, :, -1]}
    else:
        ref_o, ref_state = FORMS["naive"](q, k, v, feature_map=fm, g=g, initial_state=initial)
    check_against(o, state, ref_o, ref_state, dtype)


@pytest.mark.parametrize(
    "shape",
    [(2, H, 9, N_FEATURES + 1), (2, H, 9, D), (2, H, 8), (2, 1, 9), (H, 9), (2, H, 9, 1), (2, H, 9, N_FEATURES, 1)],
    ids=lambda s: "x".join(map(str, s)),
)
@pytest.mark.parametrize("form", [*SEQUENCE_FORMS, "step"])
def test_bad_decay_shape_is_refused(form, shape):
    """A g of the wrong shape (one that would broadcast included) raises, naming the expected shapes."""
    fm = feature_map("performer")  # F = 12 != D = 8: a [B, H, T, D] g is wrong too
    T = 1 if form == "step" else 9
    shape = tuple(T if s == 9 else s for s in shape)
    q = torch.randn(2, H, T, D)
    fn = recurrent_step if form == "step" else FORMS[form]
    with pytest.raises(ValueError, match=rf"g \(log-decay\) must be .*\[2, {H}, {T}\].*\[2, {H}, {T}, {N_FEATURES}\]"):
        fn(q, q, q, feature_map=fm, g=torch.zeros(shape))


def test_integer_decay_is_refused():
    q = torch.randn(2, H, 5, D)
    with pytest.raises(ValueError, match="float tensor"):
        chunk_linear_attention(q, q, q, feature_map=feature_map("elu+1"), g=torch.zeros(2, H, 5, dtype=torch.int64))


# ---- export: the chunked form with each kind of gate through torch.onnx, run by ONNX Runtime ----

EXPORT_CALLS = (  # (feature map, normalize, gate): one chunk_linear_attention call each in one graph
    ("elu+1", True, "scalar"),
    ("identity", False, "feature"),
    ("performer", True, "feature"),
    ("relu", False, "fixed"),
)


class DecayedChunks(torch.nn.Module):
    """Inputs: q, k, v [B, H, T, D]; per call g, S (and z if normalised). Outputs: per call o, S (and z)."""

    def __init__(self):
        super().__init__()
        self.maps = torch.nn.ModuleList(feature_map(name) for name, _, _ in EXPORT_CALLS)

    def forward(self, q, k, v, *per_call):
        outs, rest = [], list(per_call)
        for fm, (_, normalize, _) in zip(self.maps, EXPORT_CALLS):
            g, S = rest.pop(0), rest.pop(0)
            state = {"S": S, "z": rest.pop(0)} if normalize else {"S": S}
            o, new = chunk_linear_attention(q, k, v, feature_map=fm, initial_state=state, chunk_size=C, normalize=normalize, g=g)
            outs += [o, *new.values()]
        return tuple(outs)


def export_inputs(B: int, T: int, seed: int) -> list[torch.Tensor]:
    inputs = [x.float() for x in random_qkv(B, T, seed)]
    for i, (name, normalize, kind) in enumerate(EXPORT_CALLS):
        f = feature_map(name).out_dim
        gen = torch.Generator().manual_seed(seed + i)
        inputs += [make_gate(kind, B, T, f, seed + i).float(), torch.rand(B, H, f, D, generator=gen)]  # g, S
        if normalize:
            inputs.append(torch.rand(B, H, f, generator=gen) + 1.0)  # z
    return inputs


@pytest.fixture(scope="module")
def decayed_session(export_cache):
    ort = pytest.importorskip("onnxruntime")
    module = DecayedChunks().eval()
    folder = export_cache.get("decayed-chunks", [list(c) for c in EXPORT_CALLS], lambda folder: _export_decayed(module, folder))
    return module, ort.InferenceSession(str(folder / "decayed.onnx"), providers=["CPUExecutionProvider"])


def _export_decayed(module, folder):
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    example = export_inputs(2, 2 * C + 3, seed=31)  # T > C and batch 2: a smaller example can export a wrong graph
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    per_call = []  # *per_call is one argument to torch.export
    for _, normalize, _ in EXPORT_CALLS:
        per_call += [{0: batch, 2: seq}, {0: batch}] + ([{0: batch}] if normalize else [])
    dynamic = [{0: batch, 2: seq}] * 3 + [tuple(per_call)]
    folder.mkdir()
    path = folder / "decayed.onnx"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*axis name.*will not be used")  # batch, seq shared by inputs
        program = torch.onnx.export(
            module, tuple(example), dynamic_shapes=tuple(dynamic), dynamo=True, opset_version=18, optimize=True, verbose=False
        )
    program.save(str(path))


@pytest.mark.parametrize("T", [1, C - 1, C, C + 1, 200])
def test_exported_chunk_form_matches_torch(decayed_session, T):
    """ONNX Runtime runs the exported graph at lengths and a batch it was not traced with."""
    module, session = decayed_session
    inputs = export_inputs(3, T, seed=40 + T)
    names = [i.name for i in session.get_inputs()]
    assert len(names) == len(inputs), f"the exported graph has {len(names)} inputs for {len(inputs)} given"
    with torch.no_grad():
        expected = module(*inputs)
    got = session.run(None, {name: x.numpy() for name, x in zip(names, inputs)})
    assert len(got) == len(expected)
    worst = max(float(abs(e.numpy() - g).max()) for e, g in zip(expected, got))
    assert math.isfinite(worst) and worst <= 1e-4, f"ONNX Runtime vs PyTorch: max abs {worst:.3g}"
