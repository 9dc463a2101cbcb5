"""`edgelin bench --quick`: every section is in the JSON with finite, positive numbers; bad options are one line.

No timing assertions: the suite runs on busy machines. One quick run (a tiny checkpoint, so the graph
exports stay short) feeds every structural test.
"""

from __future__ import annotations

import json
import types
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from edgelin.bench import SECTIONS, _finite, interleaved, stats, write_json_atomic, write_plots
from edgelin.cli.bench import bench
from edgelin.runtime.files import write_json
from testkit.protocol import Delegating

STAT_KEYS = ("median", "p10", "p90", "min", "max")


@pytest.fixture(scope="module")
def checkpoint(export_cache):
    from edgelin.checkpoint import save_checkpoint
    from edgelin.config import ModelConfig
    from edgelin.model import LinearLM

    def build(folder):
        torch.manual_seed(0)
        save_checkpoint(LinearLM(ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, head_dim=16, chunk_size=16)), folder)

    return export_cache.get("bench-ckpt", "LinearLM seed 0, 1 layer, d_model 32", build)


@pytest.fixture(scope="module")
def quick(checkpoint, export_cache):
    """One `edgelin bench --quick` run per test run (shared by the xdist workers): (bench.json, the CLI's
    result: exit_code, output, stdout, stderr; the results folder)."""

    def build(folder):
        folder.mkdir()
        out = folder / "results"
        result = CliRunner().invoke(bench, [str(checkpoint), "--quick", "--threads", "1", "--out", str(out)])
        assert result.exit_code == 0, result.output + repr(result.exception)
        (folder / "result.json").write_text(json.dumps({"exit_code": result.exit_code, "output": result.output, "stdout": result.stdout, "stderr": result.stderr}))

    folder = export_cache.get("bench-quick", str(checkpoint), build)
    result = types.SimpleNamespace(**json.loads((folder / "result.json").read_text()))
    return json.loads((folder / "results" / "bench.json").read_text()), result, folder / "results"


def positive(x, where):
    assert isinstance(x, (int, float)) and not isinstance(x, bool), f"{where}: {x!r} is not a number"
    assert math.isfinite(x) and x > 0, f"{where}: {x!r} is not finite and positive"


def positive_stats(s, where):
    for key in STAT_KEYS:
        positive(s[key], f"{where}.{key}")
    assert s["p10"] <= s["median"] <= s["p90"], where
    assert s["n"] >= 2, where


def all_numbers_finite(x, where="json"):
    if isinstance(x, dict):
        for k, v in x.items():
            all_numbers_finite(v, f"{where}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            all_numbers_finite(v, f"{where}[{i}]")
    elif isinstance(x, float):
        assert math.isfinite(x) and x >= 0, f"{where}: {x!r}"


def test_quick_json_has_every_section(quick):
    data, result, _ = quick
    assert data["format"] == "edgelin-bench/1" and data["quick"] is True
    for section in SECTIONS:
        assert section in data, section
    all_numbers_finite({k: data[k] for k in SECTIONS})
    s = data["settings"]
    assert s["threads"] == s["torch_threads"] == s["ort_intra_op_threads"] == 1
    assert s["provider_requested"] == "cpu" and s["provider_active"] == "cpu"
    m = data["machine"]
    assert m["cores"] >= 1 and m["cpu_model"] and m["versions"]["onnxruntime"] and m["versions"]["torch"] and m["versions"]["numpy"]
    assert data["model"]["random_weights"] is False and data["model"]["parameters"] > 0
    assert all(v <= 1e-4 for v in data["method"]["verification"]["max_abs_error"].values())
    assert "peak" in data["method"]["memory"] and "tracemalloc" in data["method"]["memory"]


def test_quick_decode(quick):
    decode = quick[0]["decode"]
    assert set(decode["batches"]) == {"1", "8"}
    for B, row in decode["batches"].items():
        for name in ("torch_eager", "ort_run", "ort_iobinding"):
            positive_stats(row[name], f"decode[{B}].{name}")
            positive(row[name]["tokens_per_s"], f"decode[{B}].{name}.tokens_per_s")
        for key, value in row["ratios"].items():
            positive(value, f"decode[{B}].ratios.{key}")
    for graph, nodes in decode["graph_nodes"].items():
        # ONNX Runtime fuses at load (at least each RMSNorm into one node): fewer nodes run than were exported
        assert 0 < nodes["as_run"] < nodes["exported"], (graph, nodes)
        assert sum(nodes["as_run_ops"].values()) == nodes["as_run"]
    assert decode["graph_nodes"]["decode"]["as_run_ops"]["SimplifiedLayerNormalization"] == 2 * quick[0]["model"]["config"]["n_layers"] + 1


def test_quick_goals(quick):
    data, result, _ = quick
    entries = {g["goal"]: g for g in data["goals"]}
    assert set(entries) == {"eager_over_ort", "nodes_per_layer", "over_floor", "long_prefill", "vs_softmax", "batch_throughput"}
    assert entries["eager_over_ort"]["measured"] == data["decode"]["batches"]["1"]["ratios"]["torch_eager_over_ort_iobinding"]
    assert entries["over_floor"]["measured"] == data["floor"]["batches"]["1"]["measured_over_floor"]
    layers = data["model"]["config"]["n_layers"]
    assert entries["nodes_per_layer"]["measured"] == data["decode"]["graph_nodes"]["decode"]["as_run"] / layers
    for g in entries.values():
        assert g["met"] is (None if g["target"] is None else (g["measured"] >= g["target"] if g["direction"] == ">=" else g["measured"] <= g["target"]))
    assert "0. goals" in result.stdout


def test_goals_leave_out_what_did_not_run():
    from edgelin.bench.goals import goal_lines, goals

    record = {"model": {"config": {"n_layers": 4}},
              "decode": {"batches": {"1": {"ratios": {"torch_eager_over_ort_iobinding": 4.5}}},
                         "graph_nodes": {"decode": {"exported": 150, "as_run": 120}}},
              "floor": {"batches": {"1": {"measured_over_floor": 1.31}}}}
    entries = {g["goal"]: g for g in goals(record)}
    assert set(entries) == {"eager_over_ort", "nodes_per_layer", "over_floor"}
    assert entries["eager_over_ort"]["met"] is True and entries["over_floor"]["met"] is False
    assert entries["nodes_per_layer"]["measured"] == 30 and entries["nodes_per_layer"]["met"] is False
    assert "NOT met" in "\n".join(goal_lines(goals(record)))


def test_quick_position(quick):
    data, result, _ = quick
    rows = data["position"]["rows"]
    assert [r["position"] for r in rows] == [32, 128]
    for r in rows:
        positive_stats(r["linear_ms"], "linear_ms")
        for ms, over in (("softmax_kv_ms", "softmax_over_linear"), ("softmax_gqa_ms", "softmax_gqa_over_linear")):
            positive_stats(r[ms], ms)
            assert r[over] == pytest.approx(r[ms]["median"] / r["linear_ms"]["median"])
        # the strongest baseline is the faster of the two, and its ratio is its own
        fastest = min(("softmax_kv", "softmax_gqa"), key=lambda n: r[f"{n}_ms"]["median"])
        assert r["strongest_baseline"] == fastest and r["skipped"] == {}
        assert r["strongest_over_linear"] == pytest.approx(r[f"{fastest}_ms"]["median"] / r["linear_ms"]["median"])
        # 1 layer, 2 heads x 16: KV = 2 * 1 * 2 * P * 16 * 4 bytes; state = (2*16*16 + 2*16) * 4 bytes
        assert r["kv_cache_bytes"] == 256 * r["position"]
        assert r["linear_state_bytes"] == 2176
    assert rows[1]["kv_over_state"] > rows[0]["kv_over_state"]
    assert "GroupQueryAttention" in data["position"]["softmax_gqa_baseline"]
    assert data["method"]["verification"]["max_abs_error"]["softmax_gqa"] <= 1e-4  # checked against PyTorch before timing
    assert "softmax, GQA in place" in result.stdout and "strongest" in result.stdout


def test_quick_throughput(quick):
    data, result, _ = quick
    t = data["throughput"]
    assert list(t["batches"]) == ["1", "4"]  # QUICK's short list
    for B, row in t["batches"].items():
        positive_stats(row["ms_per_step"], f"throughput[{B}]")
        assert row["ms_per_step"]["n"] == 3 * 8  # QUICK: 3 rounds x 8 calls, through the decode section's counts
        assert row["tokens_per_s"] == pytest.approx(int(B) / (row["ms_per_step"]["median"] / 1e3))
        assert row["ms_per_token"] == pytest.approx(row["ms_per_step"]["median"] / int(B))
    assert t["batches"]["1"]["tokens_per_s_over_batch_1"] == 1.0
    assert t["best_batch"] in (1, 4) and t["best_tokens_per_s"] == t["batches"][str(t["best_batch"])]["tokens_per_s"]
    assert "1b. decode throughput vs batch" in result.stdout


def test_quick_prefill(quick):
    prefill = quick[0]["prefill"]
    ok = [r for r in prefill["rows"] if r["status"] == "ok"]
    assert {r["form"] for r in ok} == {"chunk", "parallel", "softmax", "chunk_pieces"}, prefill["skipped"]
    for r in ok:
        where = f"prefill {r['form']} T={r['T']}"
        positive_stats(r["seconds"], where)
        for key in ("tokens_per_s", "first_run_s", "peak_rss_bytes", "rss_before_bytes"):
            positive(r[key], f"{where}.{key}")
        assert r["peak_increment_bytes"] >= 0 and r["peak_rss_bytes"] >= r["rss_before_bytes"]
        assert r["memory_method"]
    assert prefill["memory_cap_bytes"] > 0 and prefill["ratios"]
    for entry in prefill["ratios"]:
        for key, value in entry.items():
            positive(value, f"ratios.{key}")
    rate = {(r["form"], r["T"]): r["tokens_per_s"] for r in ok}
    long = next(e for e in prefill["ratios"] if e["T"] == 256)  # QUICK: pieces of 64 from T = 256
    assert long["pieces_over_one_piece"] == pytest.approx(rate[("chunk_pieces", 256)] / rate[("chunk", 64)])


def test_prefill_ratios_keep_the_pieces_where_the_one_call_run_was_skipped():
    from edgelin.bench.sections import prefill_ratios

    def row(form, T, rate, status="ok"):
        return {"form": form, "T": T, "tokens_per_s": rate, "status": status}

    rows = [row("chunk", 1024, 100.0), row("softmax", 1024, 50.0), row("chunk", 4096, 80.0), row("chunk_pieces", 4096, 96.0),
            row("chunk", 65536, None, "skipped"), row("chunk_pieces", 65536, 90.0)]
    assert prefill_ratios(rows, (1024, 4096, 65536), 1024) == [
        {"T": 1024, "chunk_over_softmax": 2.0},
        {"T": 4096, "pieces_over_chunk": 1.2, "pieces_over_one_piece": 0.96},
        {"T": 65536, "pieces_over_one_piece": 0.9},  # no one-call figure to compare with, the pieces still count
    ]
    assert prefill_ratios(rows[:1], (1024,), 1024) == []  # nothing to compare: no entry


def test_quick_sweep_and_floor(quick):
    data = quick[0]
    sweep = data["sweep"]
    assert [r["chunk"] for r in sweep["rows"]] == [16, 32] and sweep["best_chunk"] in (16, 32)
    for r in sweep["rows"]:
        assert r["status"] == "ok", r
        positive(r["tokens_per_s"], "sweep.tokens_per_s")
        positive(r["over_best"], "sweep.over_best")
    floor = data["floor"]
    positive(floor["bandwidth_GBps"]["median"], "bandwidth")
    positive(floor["weight_bytes"], "weight_bytes")
    for B, row in floor["batches"].items():
        for key in ("floor_ms_per_token", "weights_only_floor_ms_per_token", "measured_ms_per_token", "measured_over_floor"):
            positive(row[key], f"floor[{B}].{key}")
        positive_stats(row["measured_ms_per_call"], f"floor[{B}].measured")


def test_quick_output_table_plots_and_progress(quick):
    data, result, out = quick
    assert "1. decode latency" in result.stdout and "4. floor" in result.stdout
    assert "threads 1" in result.stdout and "onnxruntime" in result.stdout
    assert "exporting" in result.stderr and "exporting" not in result.stdout  # progress on stderr
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert data["plots"]["files"] == [] and "matplotlib" in data["plots"]["skipped"]
    else:
        assert data["plots"]["files"] and all((out / f).stat().st_size > 0 for f in data["plots"]["files"])
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no temporary files left


def test_plots_are_skipped_without_matplotlib(quick, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    files, info = write_plots(quick[0], tmp_path)
    assert files == [] and "matplotlib is not installed" in info["skipped"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, message",
    [
        pytest.param(["--provider", "tpu"], "unknown provider 'tpu'", id="provider"),
        pytest.param(["--threads", "0"], "threads must be an integer", id="threads"),
        pytest.param(["{missing}"], "does not exist", id="missing-path"),
        pytest.param(["{empty}"], "is neither a checkpoint folder", id="not-a-model"),
        pytest.param(["--section", "everything"], "unknown section(s) 'everything'", id="section"),
        pytest.param(["--memory-cap", "-1"], r"memory cap must be a number in (0, 1,000,000] (GB)", id="memory-cap"),
    ],
)
def test_bad_options_are_one_line(tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    args = [a.format(missing=tmp_path / "nope", empty=tmp_path / "empty") for a in args]
    result = CliRunner().invoke(bench, args + ["--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgelin: error:") and message in lines[0], result.stderr


def test_cuda_request_without_cuda_fails_before_any_export(tmp_path):
    from edgelin.bench import _cuda_is_active

    if _cuda_is_active():
        pytest.skip("CUDA is active here")
    result = CliRunner().invoke(bench, ["--provider", "cuda", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "CUDA was requested" in result.stderr and "exporting" not in result.stderr


def test_stats_and_interleaving():
    s = stats([0.001, 0.002, 0.003, 0.004, 0.005])
    assert s["unit"] == "ms" and s["median"] == pytest.approx(3.0) and s["n"] == 5 and s["p10"] < s["median"] < s["p90"]
    order = []
    samples = interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, warmup=1, rounds=2, per_round=2)
    assert [len(v) for v in samples.values()] == [4, 4]
    assert order == ["a", "b", "a", "a", "b", "b", "b", "b", "a", "a"]  # warm-up, then rounds in rotating order


def test_json_is_written_atomically(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"format": "edgelin-bench/1", "old": True}))  # an earlier report: edgelin's, replaced
    write_json_atomic({"x": np.float32(1.5), "bad": float("nan"), "n": np.int64(3)}, path)
    assert json.loads(path.read_text()) == {"x": 1.5, "bad": None, "n": 3}
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]
    assert _finite([float("inf"), 2.0]) == [None, 2.0]
    write_json(tmp_path / "other.json", {"t": (1, np.float64("-inf")), "ok": np.bool_(True)})  # the one JSON writer
    assert json.loads((tmp_path / "other.json").read_text()) == {"t": [1, None], "ok": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "other.json"]


def test_package_worker_and_report_import_without_torch():
    """edgelin.bench loads its submodules on use: the worker's and the report's imports never reach torch."""
    code = ("import sys; sys.modules['torch'] = None; "
            "import edgelin.bench, edgelin.bench.measure, edgelin.bench.report, edgelin.bench.__main__; "
            "from edgelin.bench import stats, interleaved, machine_facts, format_table, BenchReport; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_prefill_worker_is_torch_free(tmp_path):
    """The peak-memory worker imports only numpy + onnxruntime, so its RSS is the graph's, not torch's."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["logits"], to=TensorProto.FLOAT)], "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence"])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), str(tmp_path / "g.onnx"))
    spec = {"graph": str(tmp_path / "g.onnx"), "provider": "cpu", "threads": 1, "batch": 1, "T": 1000, "piece": 300,
            "vocab": 256, "seed": 0, "budget_s": 0.01, "min_repeats": 2, "max_repeats": 3}
    code = ("import sys, runpy; sys.modules['torch'] = None; "
            f"sys.argv = ['bench', '--worker', {json.dumps(json.dumps(spec))}]; runpy.run_module('edgelin.bench', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["times_s"]) >= 2 and result["peak_rss_bytes"] >= result["rss_before_bytes"] > 0
    assert result["providers"] == ["CPUExecutionProvider"]


class Wrapped(Delegating):
    """Follows edgelin.protocol without being a LinearLM: no cfg, init_state or with_chunk_size."""

    def model_config(self) -> dict:
        return {"wrapped": self.inner.model_config()}


def test_any_protocol_model_is_timed_without_the_softmax_twin(checkpoint, tmp_path):
    """A model that is not a LinearLM: its export is timed through state_specs; the twin and the O(T^2) form are skipped, saying why."""
    from edgelin.bench import run_bench
    from edgelin.checkpoint import load_checkpoint

    report = run_bench(Wrapped(load_checkpoint(checkpoint)), quick=True, threads=1, out_dir=tmp_path / "out", plots=False)
    data = json.loads(report.json_path.read_text())
    assert data["model"]["config"] == {"wrapped": load_checkpoint(checkpoint).model_config()} and data["model"]["parameters"] > 0
    for B, row in data["decode"]["batches"].items():
        for name in ("torch_eager", "ort_run", "ort_iobinding"):
            positive_stats(row[name], f"decode[{B}].{name}")
    position = data["position"]
    assert position["softmax_baseline"].startswith("skipped: the model is not a LinearLM (Wrapped)")
    for r in position["rows"]:
        positive_stats(r["linear_ms"], "linear_ms")
        assert r["linear_state_bytes"] == 2176 and "softmax_kv_ms" not in r and "kv_cache_bytes" not in r
    prefill = data["prefill"]
    assert {r["form"] for r in prefill["rows"] if r["status"] == "ok"} == {"chunk", "chunk_pieces"}, prefill["skipped"]
    assert set(prefill["forms_not_run"]) == {"parallel", "softmax"} and set(prefill["forms"]) == {"chunk", "chunk_pieces"}
    sweep = data["sweep"]
    assert [r["chunk"] for r in sweep["rows"]] == [16] and "with_chunk_size" in sweep["note"]
    assert data["method"]["verification"]["max_abs_error"] == {}  # nothing exported here besides the model's own (smoke-checked) export
    table = report.table()
    assert "softmax twin skipped" in table and "not run: the model is not a LinearLM" in table and "4. floor" in table


# ---- the opt-in fla section --------------------------------------------------------------------------
def fla_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("fla", "triton"))


def test_fla_is_opt_in():
    from edgelin.bench.plan import ALL_SECTIONS, OPT_IN_SECTIONS, check_options

    assert "fla" in OPT_IN_SECTIONS and "fla" not in SECTIONS
    assert check_options(None, "cpu", 1, None)[1] == SECTIONS  # the default run does not build fla models
    assert check_options(None, "cpu", 1, ["fla", "decode", "fla"])[1] == ("decode", "fla")
    assert ALL_SECTIONS == SECTIONS + OPT_IN_SECTIONS


def test_quick_run_has_no_fla_section(quick):
    assert "fla" not in quick[0] and "5. fla" not in quick[1].stdout


@pytest.mark.skipif(not fla_installed(), reason="flash-linear-attention or triton is not installed; pip install -e '.[test]'")
def test_fla_section_quick(tmp_path):
    """fla's own model (Triton interpreter) vs the import and its ONNX decode graph: all checked, then timed."""
    out = tmp_path / "results"
    result = CliRunner().invoke(bench, ["--quick", "--section", "fla", "--no-plots", "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads((out / "bench.json").read_text())
    assert data["model"] is None and data["settings"]["sections"] == ["fla"]
    assert not set(SECTIONS) & set(data)  # the model-under-test sections did not run
    f = data["fla"]
    assert f["status"] == "ok", f  # fla is installed: a skip here would hide a broken section
    assert f["fla_config"]["feature_map"] == "elementwise_product" and f["parameters"] > 0 and f["decode_nodes"] > 0
    first = f["import_export"]["first"]
    for key in ("import_s", "export_s", "total_s"):
        positive(first[key], f"import_export.first.{key}")
    assert first["total_s"] == pytest.approx(first["import_s"] + first["export_s"])
    assert set(first["graphs_s"]) == {"prefill", "decode"}
    for name in ("ort_iobinding", "torch_eager", "fla_step"):
        positive_stats(f["decode"][name], f"fla.decode.{name}")
        assert f["decode"][name]["n"] == 6  # QUICK: 3 rounds x 2 calls
    for key, value in f["decode"]["ratios"].items():
        positive(value, f"fla.decode.ratios.{key}")
    for name, errors in f["check"]["errors"].items():
        assert all(errors[bound] <= limit for bound, limit in f["check"]["budgets"][name].items()), name
    assert "interpreter" in f["contenders"]["fla_step"] and "TRITON_INTERPRET=1" in f["contenders"]["fla_step"]
    assert "5. fla" in result.stdout and "fla_step" in result.stdout and "import + export" in result.stdout
    assert "model: none under test" in result.stdout


def test_fla_section_is_skipped_with_the_reason_when_fla_cannot_be_imported(tmp_path, monkeypatch):
    """A package named fla that fails to import, first on the worker's path: the section says why and the run succeeds."""
    from edgelin.bench import run_bench

    fake = tmp_path / "shadow" / "fla"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no fla in this test')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(fake.parent), os.environ.get("PYTHONPATH")])))
    report = run_bench(None, sections=["fla"], quick=True, threads=1, out_dir=tmp_path / "out", plots=False)
    f = json.loads(report.json_path.read_text())["fla"]
    assert f["status"] == "skipped" and "no fla in this test" in f["reason"] and "pip install" in f["reason"]
    assert "skipped: flash-linear-attention cannot be imported" in report.table()


def test_decay_section_quick(tmp_path):
    """Each decay of ModelConfig against the plain LinearLM; where ModelConfig has no decay, skipped with the reason."""
    from edgelin.bench import run_bench
    from edgelin.bench.decay import decays

    report = run_bench(None, sections=["decay"], quick=True, threads=1, out_dir=tmp_path / "out", plots=False)
    data = json.loads(report.json_path.read_text())
    x = data["decay"]
    if decays() is None:
        assert x["status"] == "skipped" and "no 'decay' field" in x["reason"]
        assert "6. decay" in report.table() and "skipped" in report.table()
        return
    assert x["status"] == "ok" and x["decays"][0] == "none" and set(x["decays"]) >= {"none", "fixed", "scalar", "gla"}
    assert x["lengths"] == [64, 256] and all(r["status"] == "ok" for r in x["prefill"]), x["prefill"]
    # one call at each length, then the longest in calls of the plan's piece (the runtime's default)
    assert [(r["T"], r["piece"]) for r in x["prefill"]] == [(64, None)] * len(x["decays"]) + [(256, None)] * len(x["decays"]) + [(256, 64)] * len(x["decays"])
    for d, m in x["models"].items():
        positive_stats(m["decode_ms"], f"decay {d} decode")
        assert (m["scaling"]["from"], m["scaling"]["to"], m["scaling"]["piece"]) == (64, 256, 64)
        positive(m["scaling"]["tokens_per_s_ratio"], f"decay {d} scaling")
        positive(m["scaling"]["pieces_tokens_per_s_ratio"], f"decay {d} scaling in pieces")
        assert m["nodes"]["decode"] > 0 and m["nodes"]["prefill"] > 0 and m["parameters"] > 0
        if d != "none":
            positive(m["decode_over_none"], f"decay {d} decode_over_none")
            assert set(m["prefill_tokens_per_s_over_none"]) == {"64", "256"}
    assert x["models"]["gla"]["parameters"] > x["models"]["none"]["parameters"]  # the gate projection's weights
    assert "6. decay" in report.table() and "in calls of 64 tokens" in report.table()
    # fla's recurrences: none in the quick plan (test_decay_fla_models_build_and_import builds them), said
    assert x["fla"]["status"] == "skipped" and "none of fla's models" in x["fla"]["reason"], x["fla"]
    assert "fla's recurrences: skipped" in report.table()


def test_decay_fla_models_build_and_import(tmp_path):
    """The decay section's fla rows: each model (fla's config at tiny widths, 2 layers as RWKV-7's init needs; fla's
    random init) builds, saves and imports through edgelin's fla importer as its family, with fla's parameter count."""
    pytest.importorskip("fla.models", reason="flash-linear-attention (with triton) is not installed")
    import fla.models

    from edgelin.bench.fla_models import FLA_MODELS, build_fla, fla_config

    for name, (config_class, model_class, _) in FLA_MODELS.items():
        config = fla_config(name, (32, 2, 2, 16))
        model = build_fla({"fla": name, "config": config, "checkpoint": str(tmp_path / name)})
        assert model.model_config()["family"] == f"fla/{name}", name
        fla_model = getattr(fla.models, model_class)(getattr(fla.models, config_class)(**config))
        assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in fla_model.parameters()), name


def test_hybrid_section_quick(tmp_path):
    """Linear, hybrid and softmax stacks of one size decoded at each position of the plan: every figure positive, the
    states as the manifests say (the linear one fixed, the KV caches growing with the position, the softmax
    stack's fastest), and the hybrid's attention at its last layer only."""
    from edgelin.bench import run_bench

    report = run_bench(None, sections=["hybrid"], quick=True, threads=1, out_dir=tmp_path / "out", plots=False)
    x = json.loads(report.json_path.read_text())["hybrid"]
    assert x["status"] == "ok" and x["positions"] == [64, 256] and x["config"]["n_layers"] == 2
    assert {s: v["attn_layers"] for s, v in x["stacks"].items()} == {"linear": [], "hybrid": [1], "softmax": [0, 1]}
    assert [(r["stack"], r["position"]) for r in x["rows"]] == [(s, p) for p in (64, 256) for s in ("linear", "hybrid", "softmax")]
    by = {(r["stack"], r["position"]): r for r in x["rows"]}
    for r in x["rows"]:
        positive_stats(r["decode_ms"], f"hybrid {r['stack']} at {r['position']}")
        positive(r["decode_over_linear"], "decode_over_linear")
    assert by[("linear", 64)]["state_bytes"] == by[("linear", 256)]["state_bytes"]
    for stack in ("hybrid", "softmax"):
        assert by[(stack, 256)]["state_bytes"] > by[(stack, 64)]["state_bytes"]
    assert by[("softmax", 256)]["state_bytes"] - by[("softmax", 64)]["state_bytes"] > by[("hybrid", 256)]["state_bytes"] - by[("hybrid", 64)]["state_bytes"]
    assert all(v["nodes"]["decode"] > 0 and v["parameters"] > 0 for v in x["stacks"].values())
    assert "10. hybrid" in report.table()


def test_transformers_section_quick(tmp_path):
    """An LFM2 checkpoint built by transformers, exported, and measured against transformers' own eager model in one
    worker: every figure positive and finite, the prompt encoded alike by both tokenizers, and the greedy ids from
    the text prompt equal to transformers' generate."""
    pytest.importorskip("transformers", reason="transformers is not installed; pip install -e '.[test]'")
    from edgelin.bench import run_bench

    report = run_bench(None, sections=["transformers"], quick=True, threads=1, out_dir=tmp_path / "out", plots=False)
    x = json.loads(report.json_path.read_text())["transformers"]
    assert x["status"] == "ok" and [r["model"] for r in x["rows"]] == ["lfm2"] and x["lengths"] == [32]
    (row,) = x["rows"]
    assert row["export_check"] == "passed" and row["model_type"] == "lfm2"
    for engine in ("transformers", "edgelin"):
        positive(row["decode_ms"][engine], f"{engine} decode ms")
        positive(row["prefill_tokens_per_s"]["32"][engine], f"{engine} prefill tokens/s")
    positive(row["decode_transformers_over_edgelin"], "decode ratio")
    g = x["greedy"]["lfm2"]
    assert g["prompt_ids_equal"] and len(g["prompt_ids"]) > 10
    assert len(g["transformers"]) == 16 and g["edgelin"] == g["transformers"] and g["equal"]
    assert "11. transformers" in report.table() and "lfm2" in report.table()


def test_transformers_section_is_skipped_with_the_reason_without_transformers(monkeypatch):
    from edgelin.bench import QUICK, transformers_eager
    from edgelin.bench.report import transformers_lines

    monkeypatch.setattr("edgelin.upstream.unavailable", lambda framework: f"{framework} is not installed here")
    x = transformers_eager.transformers_section(QUICK, 1, lambda msg: None)
    assert x == {"status": "skipped", "reason": "transformers is not installed here"}
    assert "skipped" in "\n".join(transformers_lines(x))


def test_precision_section_quick(tmp_path):
    """The model in every precision, one run: smaller on disk below fp32, every figure positive, the floor
    below the measurement; an export as the source is skipped with the reason."""
    from edgelin.bench import run_bench
    from edgelin.exporters.precision import CONVERTERS

    report = run_bench(None, sections=["precision"], quick=True, threads=1, out_dir=tmp_path / "out", plots=False)
    x = json.loads(report.json_path.read_text())["precision"]
    assert x["status"] == "ok" and x["precisions"] == list(CONVERTERS) == ["fp32", "fp16", "int8", "int4"]
    assert all(r["status"] == "ok" for r in x["prefill"]) and len(x["prefill"]) == 4 * len(x["lengths"])
    size = {n: sum(m["bytes_on_disk"].values()) for n, m in x["models"].items()}
    weights = {n: m["decode_weight_bytes"] for n, m in x["models"].items()}
    assert size["fp16"] < size["fp32"] and weights["int4"] < weights["int8"] < weights["fp32"]
    for n, m in x["models"].items():
        assert m["provider_active"] == "cpu" and m["smoke_check_max_abs"]
        for B in ("1", "8"):
            positive_stats(m["decode_ms"][B], f"{n} decode batch {B}")
            assert m["floor"][B]["floor_ms_per_token"] > 0 and m["floor"][B]["measured_over_floor"] > 1
        if n != "fp32":
            positive(m["decode_over_fp32"]["1"], f"{n} decode_over_fp32")
            assert m["size_over_fp32"] < 1
    assert "7. precision" in report.table()


def test_precision_section_skips_an_export_source(tmp_path, exported):
    from edgelin.bench.precision import precision_section
    from edgelin.bench.plan import QUICK

    x = precision_section(QUICK, 1, lambda _m: None, source=exported("relu")[1])
    assert x["status"] == "skipped" and "needs the model itself" in x["reason"]


# ---- docs/performance.md's goals table is the committed bench record's --------------------------------
def _performance_goal_rows() -> list[list[str]]:
    text = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Goals\n"):]
    section = section[section.index("| goal |"):]
    section = section[: section.index("\n\n")]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()[2:]]


def test_performance_goals_table_is_the_committed_bench_record():
    """docs/bench/bench.json is the run docs/performance.md's "Goals" section quotes: its goals table must
    carry each goal of that record, in order, with the measured figure and the verdict the bench gave."""
    record = json.loads((Path(__file__).resolve().parents[1] / "docs" / "bench" / "bench.json").read_text())
    assert not record["quick"]
    rows = _performance_goal_rows()
    assert len(rows) == len(record["goals"])
    for row, goal in zip(rows, record["goals"]):
        label, target, measured, verdict = row
        assert f"{goal['measured']:.2f}" in measured, (goal["goal"], measured)
        assert verdict == {True: "met", False: "not met", None: ""}[goal["met"]], (goal["goal"], verdict)
        if goal["target"] is None:
            assert target == "reported"
        else:
            assert f"{goal['target']:g}" in target and ("≥" if goal["direction"] == ">=" else "≤") in target, (goal["goal"], target)
