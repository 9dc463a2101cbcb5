"""Golden outputs (golden.json, written by every export) and the torch-free check of execution providers against
them (``edgelin.runtime.golden``, ``edgelin check``)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from edgelin import parity
from edgelin.cli import main
from edgelin.errors import ManifestError, ProviderError
from edgelin.runtime import golden
from edgelin.runtime.manifest import Manifest, file_sha256
from edgelin.runtime import session as session_module
from edgelin.runtime.session import Session
from testkit.exports import copy_of

HYBRID = {"decay": "scalar", "attn_layers": (1,), "attn_window": 16}  # the shared hybrid export (tests/web too)


# ---- the stored rows and their comparison -------------------------------------------------------------
def test_a_whole_row_gives_exactly_the_errors_of_the_whole_row():
    rng = np.random.default_rng(1)
    ref = rng.normal(0, 3, 200).astype(np.float32)
    row = golden.summarise(ref, k=golden.TOP_K)  # V <= TOP_K: stored whole
    assert len(row["ids"]) == 200 and row["argmax"] == int(ref.argmax())
    for scale in (0.0, 1e-6, 1e-2, 5.0):
        got = ref + rng.normal(0, scale, 200).astype(np.float32)
        a, b = golden.row_errors(got, row), parity.errors(got, ref)
        assert a.max_abs == pytest.approx(b.max_abs, rel=1e-12, abs=1e-12)
        assert a.max_rel == pytest.approx(b.max_rel, rel=1e-12, abs=1e-12)
        assert a.rel_l2 == pytest.approx(b.rel_l2, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("k", [1, 16, 255])
def test_a_partial_row_gives_lower_bounds_that_still_catch_differences(k):
    rng = np.random.default_rng(k)
    V = 4096
    ref = rng.normal(0, 4, V).astype(np.float32)
    row = golden.summarise(ref, k=k)
    assert row["values"] == sorted(row["values"], reverse=True) and len(row["ids"]) == k
    assert row["absmax"] == pytest.approx(float(np.abs(ref).max())) and row["l2"] == pytest.approx(float(np.linalg.norm(ref.astype(np.float64))))
    for trial in range(200):  # never above the whole row's errors: a correct graph cannot fail on them
        got = ref + rng.normal(0, 10.0 ** rng.uniform(-7, 1), V).astype(np.float32) * (rng.random(V) < rng.random())
        lo, full = golden.row_errors(got, row), parity.errors(got, ref)
        assert lo.max_abs <= full.max_abs * (1 + 1e-9) + 1e-12
        assert lo.rel_l2 <= full.rel_l2 * (1 + 1e-9) + 1e-12
        assert lo.max_rel <= full.max_rel * (1 + 1e-9) + 1e-12
    # a difference in a stored logit is seen exactly
    got = ref.copy()
    got[row["ids"][-1]] += 0.5
    assert golden.row_errors(got, row).max_abs == pytest.approx(0.5, rel=1e-6)
    # one outside them still shows in the row's scale: a whole row scaled by 1 %
    got = ref.copy()
    outside = np.setdiff1d(np.arange(V), row["ids"])
    got[outside] *= 1.01
    assert golden.row_errors(got, row).rel_l2 > 5e-3
    # non-finite output is an infinite error
    got = ref.copy()
    got[outside[0]] = np.nan
    e = golden.row_errors(got, row)
    assert e.nonfinite == 1 and math.isinf(e.max_abs) and not parity.within(e, {"max_rel": 1.0})


def test_the_file_stays_small_for_a_250k_vocabulary():
    plan = golden.plan_for(250_000, 64)
    rng = np.random.default_rng(0)
    pre = rng.normal(0, 5, (golden.BATCH, plan.prompt.shape[1], 250_000)).astype(np.float32)
    dec = rng.normal(0, 5, (golden.BATCH, plan.decode.shape[1], 250_000)).astype(np.float32)
    text = golden.golden_text(golden.make_golden(plan, pre, dec, "fp32", parity.held("fp32")[0]))
    assert len(text.encode()) < 1 << 20
    with pytest.raises(ValueError, match="not finite"):
        pre[1, plan.positions[1], 7] = np.inf
        golden.make_golden(plan, pre, dec, "fp32", parity.held("fp32")[0])


@pytest.mark.parametrize("chunk, min_sequence", [(1, 1), (16, 1), (64, 1), (16, 9)])
def test_the_plan_compares_both_sides_of_the_chunk_boundary_and_the_second_piece(chunk, min_sequence):
    plan = golden.plan_for(300, chunk, min_sequence)
    first, second = plan.pieces
    assert first >= chunk + 1 and second >= max(4, min_sequence) and plan.prompt.shape == (golden.BATCH, first + second)
    assert set(plan.positions) == {0, max(chunk - 1, 0), chunk, first + second - 1}  # the last is in the second piece
    assert plan.decode.shape == (golden.BATCH, golden.DECODE_STEPS) and plan.prompt.max() < 300
    again = golden.plan_for(300, chunk, min_sequence)
    assert np.array_equal(again.prompt, plan.prompt) and np.array_equal(again.decode, plan.decode)


# ---- exports carry them, and the check passes and fails as it should ------------------------------------
@pytest.fixture(scope="module")
def plain(exported):
    return exported("elu+1")[1]


def test_every_export_has_golden_outputs_named_and_hashed_in_its_manifest(plain):
    m = Manifest.load(plain)
    entry = m.extra["golden"]
    path = plain / golden.GOLDEN_FILE
    assert entry == {"file": golden.GOLDEN_FILE, "sha256": file_sha256(path), "bytes": path.stat().st_size}
    g = golden.Golden.load(plain, m)
    assert g.precision == "fp32" and g.budgets["logits"] == parity.held("fp32")[0]["logits"]
    assert len(g.rows) == len(g.plan.rows) and all(len(r["ids"]) == 256 for r in g.rows)  # vocabulary 256: rows whole


def test_the_golden_outputs_are_the_pytorch_models(exported):
    """Recomputed here from a float64 copy of the model, not through the exporter's code path."""
    import copy

    import torch

    from edgelin.state import fresh_state

    model, out = exported("elu+1")
    g = golden.Golden.load(out, Manifest.load(out))
    m64 = copy.deepcopy(model).double()
    with torch.no_grad():
        logits, state = m64(torch.from_numpy(g.plan.prompt), fresh_state(tuple(m64.state_specs()), golden.BATCH, dtype=torch.float64))
        refs = [logits[b, at].numpy() for b in range(golden.BATCH) for at in g.plan.positions]
        steps = []
        for t in range(g.plan.decode.shape[1]):
            step, state = m64.step(torch.from_numpy(g.plan.decode[:, t:t + 1]), state)
            steps.append(step[:, 0].numpy())
    refs += [steps[t][b] for b in range(golden.BATCH) for t in range(len(steps))]
    assert len(refs) == len(g.rows)
    for ref, row in zip(refs, g.rows):
        assert parity.within(golden.row_errors(ref, row), {"max_rel": 1e-5, "rel_l2": 1e-5})
        assert row["argmax"] == int(np.argmax(ref))


@pytest.mark.parametrize("which", ["plain", "hybrid", "ragged", "int8"])
def test_check_passes_on_correct_exports(exported, which):
    out = {
        "plain": lambda: exported("elu+1")[1],
        "hybrid": lambda: exported("elu+1", **HYBRID)[1],
        "ragged": lambda: exported("cosformer", options={"ragged": True})[1],
        "int8": lambda: exported("elu+1", options={"precision": "int8", "state_dtype": "float32", "check": True})[1],
    }[which]()
    report = golden.check(out, ["cpu"], threads=1)
    assert report.passed, report.table()
    [run] = report.runs
    assert [r.name.split(" (")[0] for r in run.results] == ["prefill vs golden", "decode vs golden"]
    assert run.decode_ms > 0
    if which == "int8":  # held to the int8 budget, which an fp32 budget would not pass
        assert run.results[0].budget == parity.held("int8")[0]["logits"]
        assert not all(parity.within(r.errors, parity.held("fp32")[0]["logits"]) for r in run.results)


class Perturbed:
    """A session whose decode logits (from ``step`` on) are off by ``by`` times their scale."""

    def __init__(self, session: Session, by: float, graph: str = "decode"):
        self.s, self.by, self.graph = session, by, graph

    def new_state(self, batch):
        return self.s.new_state(batch)

    def prefill(self, ids, state):
        out = self.s.prefill(ids, state)
        return out * (1 + self.by) if self.graph == "prefill" else out

    def decode(self, ids, state):
        out = self.s.decode(ids, state)
        return out * (1 + self.by) if self.graph == "decode" else out


@pytest.mark.parametrize("graph", ["prefill", "decode"])
def test_check_fails_where_a_provider_computes_otherwise(plain, graph):
    def make(d, name):
        s = Session(d, provider="cpu", threads=1)
        return s if name == "cpu" else Perturbed(s, 1e-3, graph)

    report = golden.check(plain, ["cpu", "openvino"], open_session=make, timing=False)
    assert not report.passed
    cpu, other = report.runs
    assert all(r.passed for r in cpu.results)
    failed = {r.name.split(" (")[0]: r.where for r in other.results if not r.passed}
    assert set(failed) == {f"{graph} vs golden", f"{graph} vs cpu"}
    assert failed[f"{graph} vs cpu"].startswith(f"{graph} {'position' if graph == 'prefill' else 'step'} ")
    assert "FAIL" in report.table().splitlines()[-1]


def _edit_golden(src, dst, edit):
    out = copy_of(src, dst)
    path = out / golden.GOLDEN_FILE
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(golden.golden_text(d))
    m = json.loads((out / "edgelin.json").read_text())
    m["golden"].update(sha256=file_sha256(path), bytes=path.stat().st_size)
    (out / "edgelin.json").write_text(json.dumps(m, indent=2))
    return out


def test_a_golden_value_off_by_one_is_caught_at_its_row(plain, tmp_path):
    def edit(d):
        row = next(r for r in d["rows"] if r["graph"] == "decode" and r["batch"] == 1 and r["at"] == 5)
        row["values"][3] += 1.0

    out = _edit_golden(plain, tmp_path / "x", edit)
    report = golden.check(out, ["cpu"], timing=False)
    bad = [r for r in report.runs[0].results if not r.passed]
    assert [r.name.split(" (")[0] for r in bad] == ["decode vs golden"]
    assert bad[0].where.startswith("decode step 5 of prompt 1:") and bad[0].errors.max_abs == pytest.approx(1.0, abs=1e-4)


def test_a_changed_or_missing_golden_file_is_refused(plain, tmp_path):
    out = copy_of(plain, tmp_path / "changed")
    path = out / golden.GOLDEN_FILE
    text = path.read_text()
    path.write_text(text.replace('"precision":"fp32"', '"precision":"fp33"'))  # same size, other bytes
    with pytest.raises(ManifestError, match="golden.json is not the file edgelin.json records"):
        golden.check(out, ["cpu"])
    path.write_text(text + " ")
    with pytest.raises(ManifestError, match=r"golden.json is [\d,]+ bytes but edgelin.json says"):
        golden.check(out, ["cpu"])
    path.unlink()
    with pytest.raises(ManifestError, match="lacks golden.json"):
        golden.check(out, ["cpu"])
    for name, edit, why in [
        ("rows", lambda d: d["rows"].pop(), "its rows are not the ones its plan compares"),
        ("id", lambda d: d["rows"][3]["ids"].__setitem__(0, 10**6), "its ids are not distinct ids of the vocabulary"),
        ("twice", lambda d: d["rows"][3]["ids"].__setitem__(1, d["rows"][3]["ids"][0]), "its ids are not distinct"),
        ("l2", lambda d: d["rows"][0].__setitem__("l2", -1.0), "non-finite or negative"),
        ("prompt", lambda d: d["prompt"][0].__setitem__(0, 256), "token ids outside the vocabulary"),
    ]:
        bad = _edit_golden(plain, tmp_path / name, edit)
        with pytest.raises(ManifestError, match=f"not a golden outputs file edgelin can read .*{why}"):
            golden.check(bad, ["cpu"])


def test_an_export_without_golden_outputs_gets_the_comparison_across_providers(plain, tmp_path):
    out = copy_of(plain, tmp_path / "old")
    (out / golden.GOLDEN_FILE).unlink()
    m = json.loads((out / "edgelin.json").read_text())
    del m["golden"]
    (out / "edgelin.json").write_text(json.dumps(m, indent=2))
    alone = golden.check(out, ["cpu"], timing=False)
    assert not alone.golden and not alone.passed and not alone.compared
    assert "has no golden outputs" in alone.table() and "nothing was compared" in alone.table().splitlines()[-1]
    both = golden.check(out, ["cpu", "openvino"], open_session=lambda d, n: Session(d, provider="cpu"), timing=False)
    assert both.passed and [r.group for r in both.runs[1].results] == ["providers", "providers"]


# ---- providers and the command line -------------------------------------------------------------------
def test_a_provider_this_build_lacks_is_named_with_the_package_to_install(plain):
    import onnxruntime as ort

    if "OpenVINOExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime build has OpenVINO")
    with pytest.raises(ProviderError, match=r"no OpenVINOExecutionProvider \(it has .*CPUExecutionProvider.*\); install onnxruntime-openvino"):
        Session(plain, provider="openvino")
    report = golden.check(plain, ["cpu", "openvino"], timing=False)
    assert not report.passed and report.runs[1].status.startswith("not available: openvino was requested")
    assert report.table().splitlines()[-1].endswith("-- not available: openvino")


def test_a_plugin_provider_whose_package_is_missing_is_named(plain):
    import importlib.util

    if importlib.util.find_spec("onnxruntime_ep_webgpu") is not None:
        pytest.skip("onnxruntime-ep-webgpu is installed here")
    with pytest.raises(ProviderError, match="the onnxruntime_ep_webgpu package is not installed; install onnxruntime-ep-webgpu"):
        Session(plain, provider="webgpu")


def test_a_provider_that_copies_its_inputs_at_bind_time_gets_this_steps_ids(plain, monkeypatch):
    """A provider on a device (CUDA, WebGPU) copies an input when it is bound. Simulated on CPU: the token ids are
    copied at bind time and bindings are not kept (as for a provider outside host memory); decode must still give
    the logits of a run without IO binding. (WebGPU decoded stale ids before the ids were written before binding.)"""
    from edgelin.runtime import session as session_module

    real = session_module.to_ortvalue
    monkeypatch.setattr(session_module, "to_ortvalue", lambda a, device: real(a.copy() if a.dtype == np.int64 else a, device))
    monkeypatch.setattr(session_module, "HOST_MEMORY", ())
    bound, plain_run = Session(plain, provider="cpu", threads=1), Session(plain, provider="cpu", threads=1, io_binding=False)
    plan = golden.plan_for(256, 16)
    assert np.array_equal(golden.run_plan(bound, plan), golden.run_plan(plain_run, plan))


def test_a_provider_that_fails_while_it_runs_is_reported_not_raised(plain):
    class Failing(Perturbed):
        def decode(self, ids, state):
            raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : a kernel failed\nsecond line")

    report = golden.check(plain, ["cpu", "openvino"], open_session=lambda d, n: Session(d, provider="cpu") if n == "cpu" else
                          Failing(Session(d, provider="cpu"), 0.0), timing=False)
    assert not report.passed and report.runs[1].status.startswith("failed: ONNX Runtime raised RuntimeError running the graphs: [ONNXRuntimeError]")
    assert "second line" not in report.runs[1].status
    assert report.table().splitlines()[-1].endswith("-- failed to run: openvino")


def test_the_cli(plain, tmp_path, monkeypatch):
    runner = CliRunner()
    ok = runner.invoke(main, ["check", str(plain), "--json", str(tmp_path / "c.json"), "--threads", "1"])
    assert ok.exit_code == 0, ok.output
    assert ok.output.splitlines()[-1].startswith("PASS: 2 of 2 comparisons within budget")
    d = json.loads((tmp_path / "c.json").read_text())
    assert d["format"] == "edgelin-check/1" and d["passed"] and d["providers"][0]["results"][0]["max_rel"] < 1e-5
    again = runner.invoke(main, ["check", str(plain), "--json", str(tmp_path / "c.json")])  # its own report: replaced
    assert again.exit_code == 0
    (tmp_path / "mine.json").write_text("{}")
    for args, message in [
        (["--providers", "tpu"], "--providers must be a comma list of cpu, cuda, openvino"),
        (["--providers", "cpu,cpu"], "names a provider twice"),
        (["--providers", ""], "--providers must be"),
        (["--threads", "0"], "--threads must be"),
        (["--json", str(tmp_path / "mine.json")], "mine.json"),
    ]:
        r = runner.invoke(main, ["check", str(plain), *args])
        assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output, (args, r.output)
    assert (tmp_path / "mine.json").read_text() == "{}"
    r = runner.invoke(main, ["check", str(tmp_path)])
    assert r.exit_code == 2 and "not an edgelin export" in r.output
    made = []  # --no-prepack: the sessions read the weights in place, and pass as packed ones do
    real = session_module.make_session_options
    monkeypatch.setattr(session_module, "make_session_options", lambda *a, **k: made.append(k.get("prepack")) or real(*a, **k))
    unpacked = runner.invoke(main, ["check", str(plain), "--threads", "1", "--no-prepack"])
    assert unpacked.exit_code == 0 and unpacked.output.splitlines()[-1].startswith("PASS: 2 of 2"), unpacked.output
    assert made and not any(made), made
    cuda = runner.invoke(main, ["check", str(plain), "--providers", "cpu,cuda"])
    if "NOT AVAILABLE" in cuda.output:  # no usable GPU: refused by name, exit 1
        assert cuda.exit_code == 1 and cuda.output.splitlines()[-1].endswith("-- not available: cuda")
    else:
        assert cuda.exit_code == 0, cuda.output
