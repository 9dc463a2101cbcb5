"""The bench's opt-in ``genai`` section without onnxruntime-genai and without network: its plan (what would run, in which
order), the rounds interleaved, the table and the record written from canned measurements, and its one-line failures (a
venv without genai, a builder that fails, llama-bench's repacked path crashing). A fake venv Python (a shell script)
stands in for genai's builder and its version probe; the measuring processes give canned figures."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgelin.bench import genai, genai_rounds
from edgelin.bench.plan import FULL, OPT_IN_SECTIONS, QUICK, SECTIONS, BenchError
from edgelin.bench.report import format_table, genai_lines
from edgelin.cli.bench import bench

FAKE_PYTHON = """#!/bin/sh
# a venv's Python: the version probe, and genai's builder (-o OUT): writes a build, or fails when FAKE_BUILDER_FAILS is set
case "$*" in
  *onnxruntime_genai.models.builder*)
    while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out=$2; shift; done
    echo "Saving ONNX model in $out"
    if [ -n "$FAKE_BUILDER_FAILS" ]; then echo "NotImplementedError: The Foo architecture is not supported." >&2; exit 1; fi
    mkdir -p "$out"; echo '{}' > "$out/genai_config.json"; head -c 1000 /dev/zero > "$out/model.onnx"
    head -c 4000 /dev/zero > "$out/model.onnx.data";;
  *) echo '{"onnxruntime_genai": "0.18.0", "onnxruntime": "1.32.0"}';;
esac
"""


def fake_venv(folder: Path) -> Path:
    py = genai.venv_python(folder)
    py.parent.mkdir(parents=True)
    py.write_text(FAKE_PYTHON)
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    return folder


def fake_profile(path: Path, per_step: dict[str, tuple[float, int]], steps: int, before: int = 2) -> Path:
    """An ONNX Runtime profile as it writes one: ``before`` runs first (a prompt, warm-up: their nodes cost 1000 µs each) and then
    ``steps`` runs whose nodes of each op type cost ``per_step[op] = (µs per step, nodes per step)`` evenly; a session event outside
    every run."""
    events, ts = [{"cat": "Session", "name": "session_initialization", "ts": 0, "dur": 500, "args": {}}], 1000
    for r in range(before + steps):
        start = ts
        for op, (us, nodes) in per_step.items():
            for i in range(nodes):
                dur = 1000 if r < before else us / nodes
                events.append({"cat": "Node", "name": f"{op}_{i}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}})
                events.append({"cat": "Node", "name": f"{op}_{i}_fence_before", "ts": ts, "dur": 0, "args": {"op_name": op}})
                ts += dur + 1
        events.append({"cat": "Session", "name": "model_run", "ts": start, "dur": ts - start + 5, "args": {}})
        ts += 100
    path.write_text(json.dumps(events))
    return path


def fake_build(name, folder, models, auto_class="AutoModelForCausalLM"):
    model_type, config = models[name]
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, **config}))
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


def test_the_section_is_opt_in_and_its_plans_sizes():
    assert "genai" in OPT_IN_SECTIONS and "genai" not in SECTIONS
    assert (FULL.genai_prompt, FULL.genai_decode, FULL.genai_rounds, FULL.genai_threads) == (512, 64, 5, (1, 2))
    assert FULL.genai_models == ("lfm2-350m", "qwen3.5-0.8b") and set(FULL.genai_precisions) == set(genai.EXPORT_OPTIONS)
    assert set(QUICK.genai_models) <= set(genai.MODELS)
    # the published configurations, shared with scripts/real_size.py; Qwen3.5 in the form genai's builder reads
    assert genai.MODELS["lfm2-350m"][1]["hidden_size"] == 1024 and genai.MODELS["lfm2-350m"][1]["num_hidden_layers"] == 16
    qwen = genai.MODELS["qwen3.5-0.8b"]
    assert qwen[0] == "qwen3_5" and qwen[2] == "AutoModelForImageTextToText" and qwen[1]["text_config"]["vocab_size"] == 248320


def test_the_plan_says_what_runs_in_which_order():
    steps = genai.plan_of(FULL, ["lfm2-350m"], ("fp32", "int4", "int4-table4"), (1, 2), ("portable", "fused"), llama=True)
    kinds = [s["step"] for s in steps]
    assert kinds[0] == "checkpoint"
    # int4-table4 is compared with genai's one int4 build: two builds for three precisions
    assert [s["precision"] for s in steps if s["step"] == "genai build"] == ["fp32", "int4"]
    assert len([s for s in steps if s["step"] == "edgelin export"]) == 6
    assert next(s for s in steps if s["step"] == "gguf")["types"] == ["F32", "Q4_0"]
    rounds = {(s["precision"], s["threads"]): s["rounds"] for s in steps if s["step"] == "rounds"}
    assert set(rounds) == {(p, t) for p in ("fp32", "int4", "int4-table4") for t in (1, 2)}
    # every contender once per round, the order reversed every other round
    forward = ["edgelin portable", "edgelin fused", "genai", "llama.cpp Q4_0"]
    assert rounds["int4", 2] == [forward, forward[::-1]] * 2 + [forward] and FULL.genai_rounds == 5
    assert rounds["int4-table4", 1][0] == ["edgelin portable", "edgelin fused", "genai"]  # no GGUF of genai's 4-bit table layout
    # after each precision's rounds at the most threads, one profiled run of each contender on ONNX Runtime (not llama.cpp)
    profiles = [(s["precision"], s["threads"], s["contenders"]) for s in steps if s["step"] == "profile"]
    assert profiles == [(p, 2, ["edgelin portable", "edgelin fused", "genai"]) for p in ("fp32", "int4", "int4-table4")]
    order = [(s["step"], s.get("precision"), s.get("threads")) for s in steps if s["step"] in ("rounds", "profile")]
    assert order.index(("profile", "int4", 2)) == order.index(("rounds", "int4", 2)) + 1
    lines = genai.describe_plan(steps, FULL)
    assert "one 512-token call" in lines[0] and "64 greedy steps" in lines[0] and len(lines) == 1 + len(rounds) + len(profiles)
    assert "profiler" in lines[3] and not any(s["step"] == "profile"
                                              for s in genai.plan_of(FULL, ["lfm2-350m"], ("fp32",), (1, 2), ("fused",), True, profile=False))


def run_canned(monkeypatch, tmp_path, llama=None):
    """The section run on the fake venv, with canned measurements: edgelin decodes 20 / 24 tokens/s (portable / fused)
    against genai's 25, prefills 400 against 320; the processes' order is kept in ``calls``. ``llama``: a fake
    llama-bench, with llama.cpp's conversion faked."""
    from edgelin.bench import llamacpp

    calls = []
    speeds = {"genai": (25.0, 320.0), "portable": (20.0, 400.0), "fused": (24.0, 400.0)}
    costs = {"genai": {"MatMulNBits": (900.0, 9), "GroupQueryAttention": (60.0, 2)},  # µs, nodes per decode step
             "portable": {"MatMulNBits": (800.0, 11), "Concat": (300.0, 4)}, "fused": {"MatMulNBits": (800.0, 11), "GroupQueryAttention": (200.0, 2)}}

    def measure(cmd, what):
        spec = json.loads(cmd[-1])
        who = "genai" if "genai's" in what else Path(spec["folder"]).name.rsplit("-", 1)[1]
        if spec.get("profile"):  # the profiled run after the rounds: its file, not timed
            return {"profile": str(fake_profile(Path(spec["profile"]) / "p.json", costs[who], spec["decode"])), "decode_s": [1.0] * spec["decode"],
                    "prefill_s": 1.0, "load_s": 0.1, "ids": []}
        calls.append((who, Path(spec["folder"]).name, spec["threads"]))
        decode, prefill = speeds[who]
        ids = list(range(spec["decode"])) if who != "fused" else [0, 1, 99] + list(range(3, spec["decode"]))
        return {"load_s": 0.1, "prefill_s": len(spec["prompt"]) / prefill, "decode_s": [1 / decode] * spec["decode"], "ids": ids}

    def export(ckpt, out, precision, ops, say, trace_cache=None):
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode.onnx").write_bytes(b"\0" * 100)
        (out / "weights.data").write_bytes(b"\0" * 3000)
        (out / "edgelin.json").write_text("{}")
        return {"options": {**genai.EXPORT_OPTIONS[precision], "ops": ops}, "check": "passed", "export_s": 1.0}

    def gguf(src, ckpt, out, kinds):
        for k in kinds:
            (out / f"{k}.gguf").write_bytes(b"\0" * 2000)
        return {k: out / f"{k}.gguf" for k in kinds}

    monkeypatch.setattr(genai, "measure_process", measure)
    monkeypatch.setattr(genai, "edgelin_export", export)
    monkeypatch.setattr(genai, "count_nodes", lambda py, graph: {"exported": 80, "as_run": 64 if graph.name == "model.onnx" else 160})
    monkeypatch.delenv("EDGELIN_LLAMA_CPP", raising=False)
    if llama is not None:
        monkeypatch.setattr(llamacpp, "find_llama_cpp", lambda: (tmp_path, ""))
        monkeypatch.setattr(llamacpp, "binaries", lambda src: {"llama-bench": llama})
        monkeypatch.setattr(llamacpp, "to_gguf", gguf)
    said = []
    part = genai.genai_section(QUICK, 1, said.append, venv=fake_venv(tmp_path / "venv"), cache_dir=tmp_path / "cache",
                               ops=("portable", "fused"), record_dir=tmp_path / "records", build=fake_build)
    return part, calls, said, tmp_path


@pytest.fixture
def canned(monkeypatch, tmp_path):
    return run_canned(monkeypatch, tmp_path)


def test_the_rounds_interleave_each_contender_in_its_own_process(canned):
    part, calls, said, _ = canned
    assert part["status"] == "ok" and QUICK.genai_rounds == 2
    fp32 = [(who, folder) for who, folder, _ in calls if folder.startswith(("edgelin-fp32", "genai-fp32"))]
    assert fp32 == [("portable", "edgelin-fp32-portable"), ("fused", "edgelin-fp32-fused"), ("genai", "genai-fp32"),
                    ("genai", "genai-fp32"), ("fused", "edgelin-fp32-fused"), ("portable", "edgelin-fp32-portable")]
    assert any("plan:" in s for s in said) and any("edgelin / genai: decode 0.80x, prefill 1.25x" in s for s in said)


def test_the_rows_hold_medians_ratios_bytes_nodes_and_greedy_agreement(canned):
    part, _, _, _ = canned
    m = part["models"]["lfm2-tiny"]
    rows = {(r["precision"], r["contender"]): r for r in m["rows"]}
    assert set(rows) == {(p, c) for p in ("fp32", "int4") for c in ("edgelin portable", "edgelin fused", "genai")}
    r = rows["int4", "edgelin fused"]
    assert r["decode_tokens_per_s"] == pytest.approx(24.0) and r["decode_over_genai"] == pytest.approx(24 / 25)
    assert r["prefill_over_genai"] == pytest.approx(400 / 320) and r["rounds"] == 2
    assert r["weight_bytes"] == 3100 and r["decode_nodes_per_layer"] == 160 / 4
    assert rows["int4", "genai"]["weight_bytes"] == 5000 and rows["int4", "genai"]["decode_nodes_per_layer"] == 16
    assert "decode_over_genai" not in rows["int4", "genai"]
    assert m["greedy"]["edgelin portable"]["fp32"]["agreement"] == 1.0
    assert m["greedy"]["edgelin fused"]["fp32"]["same_as_genai_before"] == 2
    assert part["llama_cpp"]["status"] == "skipped" and "EDGELIN_LLAMA_CPP" in part["llama_cpp"]["reason"]


def test_a_ratio_says_how_far_its_rounds_resolve_it():
    """A shared machine's speed moves between processes: beside the ratio of the medians, the best rounds' ratio, the
    back-to-back pairs' ratios, any round over any round, and a verdict only where every pairing agrees."""
    x = genai_rounds.ratio_rounds([10.0, 14.0, 12.0], [12.0, 13.0, 11.0])  # round r of each ran back to back
    assert x["median"] == pytest.approx(12 / 12) and x["best"] == pytest.approx(14 / 13)
    assert x["paired"] == {"median": pytest.approx(14 / 13), "min": pytest.approx(10 / 12), "max": pytest.approx(12 / 11)}
    assert x["span"] == [pytest.approx(10 / 13), pytest.approx(14 / 11)] and x["verdict"] == "not resolved"
    assert genai_rounds.ratio_rounds([20.0, 21.0], [25.0, 24.0])["verdict"] == "slower"
    assert genai_rounds.ratio_rounds([30.0, 31.0], [25.0, 29.0])["verdict"] == "faster"
    assert genai_rounds.spread([80.0, 100.0, 90.0]) == pytest.approx(0.25) and genai_rounds.spread([5.0]) == 0
    said = genai_rounds.said_rounds(x)
    assert "best rounds 1.08x" in said and "0.77-1.27x" in said and said.endswith("not resolved")
    with pytest.raises(ValueError):
        genai_rounds.ratio_rounds([], [1.0])


def test_the_table_and_the_record_come_from_the_measurements(canned):
    part, _, _, tmp = canned
    lines = genai_lines(part)
    assert lines[0].startswith("12. genai")
    row = next(x for x in lines if "int4 (edgelin's 8-bit embedding table)" in x and "edgelin fused" in x)
    assert "0.96x" in row and "1.25x" in row and " 40.0 " in row and row.rstrip().endswith("2/8")
    assert any("llama.cpp: skipped" in x for x in lines) and any("load average" in x for x in lines)
    # each row's rounds: the canned rounds are steady, so every pairing says the same
    rounds = lines[lines.index(row) + 1]
    assert "its 2 rounds' decode: fastest/slowest 1.00" in rounds and "vs genai best rounds 0.96x" in rounds and rounds.endswith("slower")
    fused = next(r for r in part["models"]["lfm2-tiny"]["rows"] if r["precision"] == "int4" and r["contender"] == "edgelin fused")
    assert fused["decode_over_genai_rounds"]["verdict"] == "slower" and fused["prefill_over_genai_rounds"]["verdict"] == "faster"
    record = json.loads((tmp / "records" / "genai-lfm2-tiny.json").read_text())
    assert record["format"] == "edgelin-bench/1" and record["genai"]["models"]["lfm2-tiny"]["rows"] == part["models"]["lfm2-tiny"]["rows"]
    assert "machine" in record and record["genai"]["load_average"]["start"] is not None
    assert "12. genai" in format_table({**record, "seconds": 1.0})
    assert genai_lines({"status": "skipped", "reason": "x"}) == [lines[0], "  skipped: x"]


def test_the_profiled_runs_say_where_each_decode_step_goes(canned):
    part, calls, said, _ = canned
    prof = part["models"]["lfm2-tiny"]["profiles"]["int4"]
    assert prof["threads"] == 1 and set(prof["contenders"]) == {"edgelin portable", "edgelin fused", "genai"}
    fused = prof["contenders"]["edgelin fused"]  # the warm-up and prompt runs before the decode steps are left out
    assert fused["steps"] == QUICK.genai_decode and fused["kernel_us"] == pytest.approx(1000.0)
    assert fused["ops"] == {"MatMulNBits": {"us": pytest.approx(800.0), "nodes": 11}, "GroupQueryAttention": {"us": pytest.approx(200.0), "nodes": 2}}
    assert len(calls) == 2 * 2 * 3  # the profiled runs are not among the timed rounds
    lines = genai_lines(part)
    head = next(i for i, x in enumerate(lines) if "ONNX Runtime's profile, int4" in x)
    assert "edgelin fused" in lines[head + 1] and "genai" in lines[head + 1]
    gqa = next(x for x in lines[head:] if x.strip().startswith("GroupQueryAttention"))
    assert gqa.split() == ["GroupQueryAttention", "-", "200", "(2)", "60", "(2)"]  # portable, fused, genai; portable has none
    assert any("one profiled run each" in s for s in said) and any(s.strip().startswith("all kernels") for s in said)


def test_a_profile_is_read_from_the_last_runs_only(tmp_path):
    from edgelin.bench.ortprofile import decode_profile

    path = fake_profile(tmp_path / "p.json", {"MatMul": (300.0, 3), "Add": (20.0, 2)}, steps=5, before=3)
    got = decode_profile(path, 5)
    assert got["ops"] == {"MatMul": {"us": pytest.approx(300.0), "nodes": 3}, "Add": {"us": pytest.approx(20.0), "nodes": 2}}
    assert got["kernel_us"] == pytest.approx(320.0) and got["run_us"] >= 320.0
    # asked for the slow runs too: the median over runs, as the timed rounds' median step (a mean would say 1,312.5)
    assert decode_profile(path, 8)["ops"]["MatMul"]["us"] == pytest.approx(300.0)
    assert decode_profile(path, 8)["ops"]["MatMul"]["nodes"] == 3
    slow = fake_profile(tmp_path / "slow.json", {"MatMul": (300.0, 3)}, steps=1, before=3)
    assert decode_profile(slow, 4)["ops"]["MatMul"]["us"] == pytest.approx(3000.0) and decode_profile(slow, 4)["kernel_us"] == pytest.approx(3000.0)
    with pytest.raises(BenchError, match="8 run"):
        decode_profile(path, 9)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(BenchError, match="bad.json"):
        decode_profile(tmp_path / "bad.json", 1)


def test_an_edgelin_round_profiles_its_decode_graph(bundled_export, tmp_path, capsys):
    """A real ONNX Runtime profile of an export's decode steps: every node of the graph as ONNX Runtime runs it, once a step."""
    from edgelin.bench.ortprofile import decode_profile

    folder = bundled_export("fp32")
    spec = {"folder": str(folder), "prompt": list(range(1, 20)), "threads": 1, "decode": 6, "warmup": 2, "profile": str(tmp_path)}
    genai_rounds.edgelin_round_main(spec)
    raw = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert Path(raw["profile"]).parent == tmp_path and len(raw["decode_s"]) == 6
    got = decode_profile(raw["profile"], 6)
    nodes = genai_rounds.count_nodes(sys.executable, Path(folder) / "decode.onnx")
    assert {op: v["nodes"] for op, v in got["ops"].items()} == nodes["as_run_ops"]
    assert all(v["us"] > 0 for v in got["ops"].values()) and 0 < got["kernel_us"] <= got["run_us"]


def test_a_second_run_reuses_the_checkpoint_and_genais_builds(canned, monkeypatch):
    _, _, said, tmp = canned
    assert any("building the checkpoint" in s for s in said) and sum("builder -p" in s for s in said) == 2
    again = []
    monkeypatch.setattr(genai, "checkpoint_for", genai.checkpoint_for)
    genai.genai_section(QUICK, 1, again.append, venv=tmp / "venv", cache_dir=tmp / "cache", build=fake_build)
    assert not any("building the checkpoint" in s or "builder -p" in s for s in again)


def test_a_venv_without_genai_says_how_to_make_one(tmp_path):
    with pytest.raises(BenchError) as err:
        genai.ensure_venv(tmp_path / "nowhere", tmp_path, print)
    msg = str(err.value)
    assert "\n" not in msg and "onnxruntime-genai" in msg and "pip install" in msg and "--genai-venv" in msg


def test_a_failing_builder_is_one_line_with_its_error_and_log(tmp_path, monkeypatch):
    py = genai.venv_python(fake_venv(tmp_path / "venv"))
    (tmp_path / "ckpt").mkdir()
    ckpt = fake_build("lfm2-tiny", tmp_path / "ckpt", {"lfm2-tiny": genai.MODELS["lfm2-tiny"][:2]})
    monkeypatch.setenv("FAKE_BUILDER_FAILS", "1")
    with pytest.raises(BenchError) as err:
        genai.genai_build(py, {"onnxruntime_genai": "0.18.0"}, ckpt, tmp_path / "genai-int4", "int4", print)
    msg = str(err.value)
    assert "\n" not in msg and "builder failed at int4" in msg and "The Foo architecture is not supported" in msg
    assert str(tmp_path / "genai-int4.log") in msg
    monkeypatch.delenv("FAKE_BUILDER_FAILS")
    built = genai.genai_build(py, {"onnxruntime_genai": "0.18.0"}, ckpt, tmp_path / "genai-int4", "int4", print)
    assert built["builder_s"] > 0 and built["peak_rss_bytes"] > 0 and "Saving ONNX model" in (tmp_path / "genai-int4.log").read_text()
    assert genai.genai_build(py, {"onnxruntime_genai": "0.18.0"}, ckpt, tmp_path / "genai-int4", "int4", print) is None  # reused


def test_unknown_precisions_models_and_a_checkpoint_without_config_are_refused(tmp_path):
    for kwargs, words in (({"precisions": ["int3"]}, "unknown int3"), ({"models": ["gpt2"]}, "unknown gpt2"),
                          ({"checkpoint": tmp_path}, "no config.json"), ({"ops": ("fast",)}, "fast")):
        with pytest.raises(BenchError, match=words):
            genai.genai_section(QUICK, 1, print, cache_dir=tmp_path, **kwargs)


LLAMA_BENCH = """#!/bin/sh
case "$*" in
  *--help*) echo "  -nr, --no-repack <0|1>   (default: 0)"; exit 0;;
  *"-nr 1"*) echo '[{"n_prompt": 64, "n_gen": 0, "avg_ts": 900.0}, {"n_prompt": 0, "n_gen": 8, "avg_ts": 40.0}]';;
  *) kill -SEGV $$;;
esac
"""


def test_llama_benchs_repack_crash_is_detected_and_said(tmp_path):
    exe = tmp_path / "llama-bench"
    exe.write_text(LLAMA_BENCH)
    exe.chmod(0o755)
    assert genai.llama_no_repack("  --repack <0|1>  (default: 1)") == ["--repack", "0"]
    assert genai.llama_no_repack("  -nr, --no-repack <0|1>") == ["-nr", "1"] and genai.llama_no_repack("") is None
    flag = genai.llama_no_repack(os.popen(f"{exe} --help").read())
    path: dict = {}
    got = genai.llama_round(exe, tmp_path / "Q4_0.gguf", 2, 64, 8, flag, path)
    assert got.pop("peak_rss_bytes") > 0 and got == {"prefill_tokens_per_s": 900.0, "decode_tokens_per_s": 40.0, "decode_ms": 25.0}
    assert path["ran"] == "repacking off" and "killed by signal 11" in path["why"] and "-nr 1" in path["why"]
    assert genai.llama_round(exe, tmp_path / "Q4_0.gguf", 2, 64, 8, flag, path)["decode_tokens_per_s"] == 40.0  # straight to -nr 1
    crashed = genai.llama_round(exe, tmp_path / "Q4_0.gguf", 2, 64, 8, None, {})
    assert crashed["status"] == "failed" and "signal 11" in crashed["reason"]


def test_genai_options_without_the_section_are_refused(tmp_path):
    result = CliRunner().invoke(bench, ["--genai-model", "lfm2-350m", "--no-plots", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "--genai-model: options of the genai section; add --section genai" in result.output


def test_llama_cpps_rows_stand_beside_them_saying_which_path_ran(monkeypatch, tmp_path):
    exe = tmp_path / "llama-bench"
    exe.write_text(LLAMA_BENCH.replace('"n_prompt": 64', f'"n_prompt": {QUICK.genai_prompt}').replace('"n_gen": 8', f'"n_gen": {QUICK.genai_decode}'))
    exe.chmod(0o755)
    part, calls, _, _ = run_canned(monkeypatch, tmp_path, llama=exe)
    rows = {(r["precision"], r["contender"]): r for r in part["models"]["lfm2-tiny"]["rows"]}
    q4 = rows["int4", "llama.cpp Q4_0"]
    assert q4["decode_tokens_per_s"] == 40.0 and q4["decode_over_genai"] == pytest.approx(40 / 25) and q4["weight_bytes"] == 2000
    assert q4["llama_cpp_path"]["ran"] == "repacking off" and "signal 11" in q4["llama_cpp_path"]["why"]
    assert ("fp32", "llama.cpp F32") in rows and part["llama_cpp"]["status"] == "ok"
    assert any("[repacking off: the default (repacked) path was killed by signal 11" in x for x in genai_lines(part))


def test_a_process_peak_memory_is_its_own_and_a_late_one_is_killed():
    code, out, err, peak = genai_rounds.run_peak([sys.executable, "-c", "import sys; b = b'x' * (300 << 20); print('done'); print('e', file=sys.stderr)"])
    assert code == 0 and out.strip() == "done" and err.strip() == "e" and peak > 300 << 20
    assert genai_rounds.run_peak([sys.executable, "-c", "pass"])[3] < 150 << 20  # the next process's own peak, not the largest so far
    assert genai_rounds.run_peak([sys.executable, "-c", "import sys; sys.exit(3)"])[0] == 3
    assert genai_rounds.run_peak([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)[0] is None
    got = genai_rounds.measure_process([sys.executable, "-c", "import json; b = b'x' * (200 << 20); print(json.dumps({'a': 1}))"], "a round")
    assert got["a"] == 1 and got["peak_rss_bytes"] > 200 << 20


def test_quantised_gguf_types_come_from_f16_unless_f32_is_asked(monkeypatch, tmp_path):
    from edgelin.bench import llamacpp

    ran = []

    def run(cmd, what, **kw):  # the converter writes --outfile; llama-quantize writes its third argument
        cmd = [str(c) for c in cmd]
        ran.append((what, cmd))
        Path(cmd[cmd.index("--outfile") + 1] if "--outfile" in cmd else cmd[2]).write_bytes(b"gguf")
        return ""

    monkeypatch.setattr(llamacpp, "_run", run)
    monkeypatch.setattr(llamacpp, "binaries", lambda src: {"llama-quantize": tmp_path / "llama-quantize"})
    (tmp_path / "a").mkdir()
    files = llamacpp.to_gguf(tmp_path, tmp_path, tmp_path / "a", ("Q4_0", "Q8_0"))
    assert sorted(files) == ["Q4_0", "Q8_0"] and [w for w, _ in ran] == ["llama.cpp's converter (f16)", "llama-quantize Q4_0", "llama-quantize Q8_0"]
    assert all(c[1].endswith("F16.gguf") for w, c in ran[1:]) and sorted(f.name for f in (tmp_path / "a").iterdir()) == ["Q4_0.gguf", "Q8_0.gguf"]
    ran.clear()
    (tmp_path / "b").mkdir()
    files = llamacpp.to_gguf(tmp_path, tmp_path, tmp_path / "b", ("F32", "Q4_0"))
    assert sorted(files) == ["F32", "Q4_0"] and ran[1][1][1].endswith("F32.gguf")
    assert sorted(f.name for f in (tmp_path / "b").iterdir()) == ["F32.gguf", "Q4_0.gguf"]


def test_an_export_runs_in_a_process_of_its_own_and_says_its_memory(tmp_path):
    import torch

    from edgelin.checkpoint import save_checkpoint
    from edgelin.config import ModelConfig
    from edgelin.model import LinearLM

    torch.manual_seed(0)
    ckpt = save_checkpoint(LinearLM(ModelConfig(vocab_size=128, d_model=32, n_layers=1, n_heads=2, head_dim=16, chunk_size=16)).eval(),
                           tmp_path / "ckpt")
    made = genai.edgelin_export(ckpt, tmp_path / "out", "int8", "portable", print)
    assert made["check"] == "passed" and made["export_s"] > 0 and (tmp_path / "out" / "edgelin.json").is_file()
    assert made["peak_rss_bytes"] > made["peak_own_bytes"] > 0  # its own process's: the mapped pages and the runtime besides
    again = genai.edgelin_export(ckpt, tmp_path / "out", "int8", "portable", print)
    assert again["reused"] and again["export_s"] == made["export_s"]


def test_the_other_contenders_go_on_where_genais_builder_fails(monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_BUILDER_FAILS", "1")
    part, calls, said, _ = run_canned(monkeypatch, tmp_path)
    assert calls and {who for who, _, _ in calls} == {"portable", "fused"}  # no genai round
    entry = part["models"]["lfm2-tiny"]
    builds = [f for f in entry["failed"] if f["round"] == "build"]
    assert len(builds) == len(QUICK.genai_precisions) and all("The Foo architecture is not supported" in f["reason"] for f in builds)
    assert entry["rows"] and all("decode_over_genai" not in r for r in entry["rows"])
    assert any("the other contenders go on without it" in line for line in said)
    assert any("edgelin portable" in line for line in genai_lines(part))  # the table prints without genai's rows
