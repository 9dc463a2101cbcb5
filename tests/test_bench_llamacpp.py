"""The bench's opt-in ``llamacpp`` section, without llama.cpp: how it is found (or skipped, with why), llama-bench's JSON
read, the precision mapping, the table. The comparison itself needs a llama.cpp build (minutes): never in this suite."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from edgelin.bench import checkpoints, llamacpp
from edgelin.bench.plan import OPT_IN_SECTIONS, QUICK, SECTIONS
from edgelin.bench.report import llamacpp_lines
from edgelin.cli.bench import bench
from edgelin.exporters.precision import CONVERTERS

# two rows of `llama-bench -p 64 -n 16 -r 1 -o json` (fields trimmed), and a combined pp+tg test
SAMPLE = json.dumps([
    {"build_commit": "unknown", "build_number": 0, "cpu_info": "AMD EPYC", "backends": "CPU", "model_type": "lfm2 ?B all F32",
     "n_threads": 1, "n_prompt": 64, "n_gen": 0, "n_depth": 0, "avg_ns": 4613555, "avg_ts": 13872.165824, "samples_ts": [13872.2]},
    {"build_commit": "unknown", "build_number": 0, "cpu_info": "AMD EPYC", "backends": "CPU", "model_type": "lfm2 ?B all F32",
     "n_threads": 1, "n_prompt": 0, "n_gen": 16, "n_depth": 0, "avg_ns": 3311702, "avg_ts": 4831.352579, "samples_ts": [4831.35]},
    {"n_prompt": 512, "n_gen": 128, "avg_ts": 900.5},
])


def test_llama_bench_json_is_read_per_test():
    assert llamacpp.parse_llama_bench(SAMPLE) == {"pp64": 13872.165824, "tg16": 4831.352579, "pp512+tg128": 900.5}


def test_every_edgelin_precision_has_its_gguf_type():
    assert set(llamacpp.PRECISIONS) == set(CONVERTERS)
    assert llamacpp.PRECISIONS == {"fp32": "F32", "fp16": "F16", "int8": "Q8_0", "int4": "Q4_0"}
    assert set(llamacpp.CONVERTED) <= set(llamacpp.PRECISIONS.values())


def test_a_variant_is_exported_with_its_options_and_compared_with_its_gguf_type(monkeypatch, tmp_path):
    import edgelin.exporters as exporters
    from edgelin.exporters.precision import check_precision, int8_scheme_choice

    calls = []
    monkeypatch.setattr(exporters, "export", lambda ckpt, out, **options: calls.append(options))
    for name, (options, kind) in llamacpp.VARIANTS.items():
        check_precision(options["precision"])
        int8_scheme_choice(options["precision"], options.get("int8_scheme"))  # options the exporter takes
        assert kind in llamacpp.PRECISIONS.values() and llamacpp.gguf_type(name) == kind
        assert llamacpp.export_checked(tmp_path, tmp_path / name, name) == "passed"
        assert calls.pop() == options
    assert llamacpp.gguf_type("int8-block") == "Q8_0" and llamacpp.gguf_type("int4") == "Q4_0"
    # one trace cache for a checkpoint's exports: given to the checked export and to its unchecked retry
    from edgelin.errors import ExportError

    def strict(ckpt, out, **options):
        calls.append(options)
        if options.get("check", True):
            raise ExportError("smoke check failed: prefill ...")

    monkeypatch.setattr(exporters, "export", strict)
    assert llamacpp.export_checked(tmp_path, tmp_path / "x", "int4", trace_cache=tmp_path / "t").startswith("failed, exported unchecked")
    assert calls == [{"precision": "int4", "trace_cache": tmp_path / "t"}, {"precision": "int4", "trace_cache": tmp_path / "t", "check": False}]


def test_an_unknown_runtime_is_refused_by_name():
    from edgelin.bench.plan import FULL, BenchError

    with pytest.raises(BenchError, match="runtimes: rust; choose from python, node, wasm"):
        llamacpp.llamacpp_section(FULL, 1, lambda msg: None, runtimes=("python", "rust"))


def test_the_section_is_opt_in():
    assert "llamacpp" in OPT_IN_SECTIONS and "llamacpp" not in SECTIONS


def test_without_the_variable_the_section_is_skipped_naming_the_build(monkeypatch):
    monkeypatch.delenv(llamacpp.ENV, raising=False)
    out = llamacpp.llamacpp_section(QUICK, 1, lambda _msg: None)
    assert out["status"] == "skipped" and "\n" not in out["reason"]
    assert llamacpp.ENV in out["reason"] and "scripts/llamacpp_build.sh" in out["reason"]


def test_a_folder_without_the_build_names_what_it_lacks(tmp_path):
    src, why = llamacpp.find_llama_cpp({llamacpp.ENV: str(tmp_path)})
    assert src is None and "llama-bench" in why and "llama-quantize" in why and "convert_hf_to_gguf.py" in why and "\n" not in why
    for path in llamacpp.binaries(tmp_path).values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    assert llamacpp.find_llama_cpp({llamacpp.ENV: str(tmp_path)}) == (tmp_path, "")


def test_cli_writes_the_skipped_section(tmp_path, monkeypatch):
    monkeypatch.delenv(llamacpp.ENV, raising=False)
    result = CliRunner().invoke(bench, ["--section", "llamacpp", "--no-plots", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "8. llamacpp" in result.stdout and f"skipped: {llamacpp.ENV} is not set" in result.stdout
    assert json.loads((tmp_path / "bench.json").read_text())["llamacpp"]["status"] == "skipped"


def test_the_table_shows_every_row_and_the_greedy_agreement():
    cell = {"edgelin_tokens_per_s": 2000.0, "llama_cpp_tokens_per_s": 4000.0, "edgelin_over_llama_cpp": 0.5}
    part = {"status": "ok", "tests": ["tg128", "pp512"], "versions": {"llama_cpp_python_sdist": "0.3.36", "build_commit": "unknown", "onnxruntime": "1.31.1"},
            "rows": [{"model": "lfm2", "precision": p, "gguf": g, "threads": t, "tg128": cell, "pp512": cell}
                     for p, g in llamacpp.PRECISIONS.items() for t in (1, 2)],
            "greedy": {"lfm2": {"edgelin": {"fp32": {"status": "ok", "agreement": 1.0, "forced_top1": 0.75}},
                                "llama.cpp": {"fp32": {"status": "failed", "reason": "exit status -11"}}}}}
    lines = llamacpp_lines(part)
    assert len([x for x in lines if "0.50x" in x]) == 8 and all(" python " in x for x in lines if "0.50x" in x)  # a record before runtimes
    assert any("edgelin: fp32 1.00 / 0.75" in x for x in lines) and any("llama.cpp: fp32 failed" in x for x in lines)
    part["rows"][0]["runtime"] = "node"
    part["runtimes_not_run"] = [{"model": "lfm2", "precision": "fp32", "threads": 2, "runtime": "wasm", "status": "failed", "reason": "out of memory"}]
    lines = llamacpp_lines(part)
    assert any(" node " in x and "0.50x" in x for x in lines) and any(" wasm " in x and "failed: out of memory" in x for x in lines)


def test_the_goals_judge_the_worst_row_at_the_bench_threads():
    """vs_llamacpp_decode / vs_llamacpp_prefill: the worst edgelin / llama.cpp ratio among the rows at the bench's
    thread count (level or better is met); rows at other thread counts do not count; no section, no goal."""
    from edgelin.bench.goals import goals

    def row(model, precision, threads, tg, pp):
        return {"model": model, "precision": precision, "gguf": "F32", "threads": threads,
                "tg128": {"edgelin_over_llama_cpp": tg}, "pp512": {"edgelin_over_llama_cpp": 9.0}, "pp4096": {"edgelin_over_llama_cpp": pp}}

    part = {"status": "ok", "tests": ["pp512", "pp4096", "tg128"],
            "rows": [row("lfm2", "fp32", 1, 1.2, 1.5), row("mamba2", "fp32", 1, 0.8, 1.1), row("mamba2", "int8", 2, 0.1, 0.1)]}
    got = {g["goal"]: g for g in goals({"settings": {"threads": 1}, "llamacpp": part})}
    assert got["vs_llamacpp_decode"]["measured"] == 0.8 and got["vs_llamacpp_decode"]["met"] is False
    assert "worst mamba2 fp32" in got["vs_llamacpp_decode"]["what"]
    assert got["vs_llamacpp_prefill"]["measured"] == 1.1 and got["vs_llamacpp_prefill"]["met"] is True
    # per runtime: node's rows count (native CPU kernels), WASM's are reported and not judged
    part["rows"] += [{**row("lfm2", "int8", 1, 0.7, 1.3), "runtime": "node"}, {**row("lfm2", "int8", 1, 0.05, 0.05), "runtime": "wasm"}]
    got = {g["goal"]: g for g in goals({"settings": {"threads": 1}, "llamacpp": part})}
    assert got["vs_llamacpp_decode"]["measured"] == 0.7 and "worst lfm2 int8/F32 (node)" in got["vs_llamacpp_decode"]["what"]
    assert got["vs_llamacpp_prefill"]["measured"] == 1.1
    assert not [g for g in goals({"settings": {"threads": 1}, "llamacpp": {"status": "skipped", "reason": "x"}}) if "llamacpp" in g["goal"]]


@pytest.mark.parametrize("size", [llamacpp.VOCAB, 1000, 65536])
def test_the_checkpoints_tokenizer_has_the_models_vocabulary(size):
    """llama.cpp's converter reads the tokenizer beside the weights: it must have exactly the model's vocabulary (the
    section's 512, and a published model's 65,536 at real size), distinct ids, bytes round-tripping, merges applied.
    (Merges of symbols the byte-level pre-tokenizer puts in different words are never reached: speed does not care.)"""
    tok = checkpoints.byte_level_tokenizer(size)
    assert tok.get_vocab_size() == size == len(set(tok.get_vocab().values()))
    text = "ab cd \u00e9\u00e8 \U0001f600 pm"
    assert tok.decode(tok.encode(text).ids) == text
    first = 256  # the first merge: a symbol doubled, one token
    assert len(tok.id_to_token(first)) == 2 and tok.encode(tok.decode([first])).ids == [first]


def test_a_tokenizer_too_large_for_byte_pairs_is_refused():
    with pytest.raises(checkpoints.BenchError, match="cannot be made"):
        checkpoints.byte_level_tokenizer(70000)


def test_a_test_no_round_measured_is_said_in_its_row_the_table_and_left_out_of_the_goals():
    """A JavaScript round reports the measurements it finished ("failed" for the others): a row's median is over the
    rounds that measured a test, a test none did is "not_measured" with its error, the table says so, and the goals
    judge the rows that have the figure and say how many lack it."""
    from edgelin.bench.goals import goals
    from edgelin.bench.llamacpp import row_tests

    theirs = [{"tg8": 100.0, "pp512": 400.0, "pp4096": 300.0}, {"tg8": 110.0, "pp512": 420.0, "pp4096": 320.0}]
    measured = [{"tg8": 20.0, "pp512": 100.0}, {"tg8": 30.0}]  # round 2 lost pp512 too; neither has pp4096
    got = row_tests(measured, theirs, ["tg8", "pp512", "pp4096"], {"pp4096": "std::bad_alloc", "pp512": "std::bad_alloc"})
    assert got["tg8"]["edgelin_tokens_per_s"] == 25.0 and got["tg8"]["edgelin_rounds"] == [20.0, 30.0]
    assert got["tg8"]["edgelin_over_llama_cpp"] == 25.0 / 105.0
    assert got["pp512"]["edgelin_rounds"] == [100.0] and got["pp512"]["llama_cpp_tokens_per_s"] == 410.0
    assert "pp4096" not in got and got["not_measured"] == {"pp4096": "std::bad_alloc"}
    assert "not_measured" not in row_tests(measured[:1], theirs, ["tg8", "pp512"])
    row = {"model": "lfm2", "precision": "fp32", "gguf": "F32", "threads": 2, "runtime": "node", **got}
    full = {"model": "lfm2", "precision": "int8", "gguf": "Q8_0", "threads": 2, "runtime": "python",
            **row_tests([{"tg8": 90.0, "pp512": 380.0, "pp4096": 270.0}], theirs, ["tg8", "pp512", "pp4096"])}
    part = {"status": "ok", "tests": ["tg8", "pp512", "pp4096"], "rows": [row, full], "greedy": {},
            "versions": {"llama_cpp_python_sdist": "0.3.36", "build_commit": "unknown", "onnxruntime": "1.31.1"}}
    lines = llamacpp_lines(part)
    assert any(" node " in x and "not measured" in x and "0.24x" in x for x in lines)  # tg8 measured, pp4096 not
    assert any(x.strip() == "node pp4096: std::bad_alloc" for x in lines)
    by = {g["goal"]: g for g in goals({"settings": {"threads": 2}, "llamacpp": part})}
    assert by["vs_llamacpp_prefill"]["measured"] == 270.0 / 310.0 and "1 row(s) not measured" in by["vs_llamacpp_prefill"]["what"]
    assert by["vs_llamacpp_decode"]["measured"] == 25.0 / 105.0 and "not measured" not in by["vs_llamacpp_decode"]["what"]
