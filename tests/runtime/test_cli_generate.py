"""`edgelin generate`: streaming, --json, state files, and one-line errors with exit status 2."""

import json

from edgelin.runtime.manifest import sync_io

import pytest
from click.testing import CliRunner

from edgelin.cli.generate import generate
from edgelin.runtime import Generator, generate_text


def invoke(*args):
    return CliRunner().invoke(generate, [str(a) for a in args])


def assert_one_line_error(result, match):
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgelin: error: "), result.stderr
    assert match in lines[0], lines[0]
    assert "Traceback" not in result.output + result.stderr


def test_streams_the_same_text_as_the_library(tiny, session):
    result = invoke(tiny[1], "--prompt", "Hello", "-n", "24", "--provider", "cpu", "--temperature", "0.7", "--seed", "4")
    assert result.exit_code == 0, result.stderr
    want = Generator(session, "Hello", max_new_tokens=24, temperature=0.7, seed=4).run().text
    assert result.stdout == want + "\n"
    assert result.stderr.startswith("[cpu] 24 new tokens (length)")
    assert "time to first token" in result.stderr and "decode" in result.stderr


def test_json_prints_one_object_with_text_and_timings(tiny):
    result = invoke(tiny[1], "--prompt", "Hello", "-n", "10", "--provider", "cpu", "--json")
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["provider"] == "cpu" and out["new_tokens"] == 10 and out["stop_reason"] == "length"
    for key in ("text", "time_to_first_token_s", "prefill_tokens_per_s", "decode_tokens_per_s", "prompt_tokens"):
        assert key in out
    assert out["text"] == generate_text(tiny[1], "Hello", max_new_tokens=10, provider="cpu")["text"]


def test_state_out_then_state_in_continues_the_conversation(tiny, session, tmp_path):
    path = tmp_path / "chat.npz"
    first = invoke(tiny[1], "-p", "Turn one.", "-n", "8", "--provider", "cpu", "--state-out", path, "--json")
    assert first.exit_code == 0, first.stderr
    assert path.is_file() and [p.name for p in tmp_path.iterdir()] == ["chat.npz"]
    second = invoke(tiny[1], "-p", " Turn two.", "-n", "8", "--provider", "cpu", "--state-in", path, "--json")
    assert second.exit_code == 0, second.stderr
    whole = list(b"Turn one.") + Generator(session, "Turn one.", max_new_tokens=8).run().results[0].ids + list(b" Turn two.")
    assert json.loads(second.stdout)["text"] == Generator(session, whole, max_new_tokens=8).run().text


def test_several_prompts_run_as_one_batch_each_as_alone(tiny, session):
    prompts = ["Hi", "A much longer prompt than the first one"]
    result = invoke(tiny[1], "-p", prompts[0], "-p", prompts[1], "-n", "12", "--provider", "cpu")
    assert result.exit_code == 0, result.stderr
    runs = [Generator(session, p, max_new_tokens=12).run() for p in prompts]
    want = [g.text for g in runs]
    blocks = [f"--- prompt {i + 1} of 2: {p!r} (length) ---\n{w}\n" for i, (p, w) in enumerate(zip(prompts, want))]
    assert result.stdout == "".join(blocks)
    assert result.stderr.startswith("[cpu] 2 prompts, 24 new tokens (2 length)")
    out = json.loads(invoke(tiny[1], "-p", prompts[0], "-p", prompts[1], "-n", "12", "--provider", "cpu", "--json").stdout)
    assert out["results"] == [{"prompt": p, "text": g.text, "ids": g.results[0].ids, "stop_reason": "length"} for p, g in zip(prompts, runs)]
    assert "text" not in out and out["new_tokens"] == 24


def test_a_batch_state_out_then_state_in_continues_every_conversation(tiny, session, tmp_path):
    path = tmp_path / "two.npz"
    first = invoke(tiny[1], "-p", "One.", "-p", "Second one.", "-n", "6", "--provider", "cpu", "--state-out", path, "--json")
    assert first.exit_code == 0, first.stderr
    second = invoke(tiny[1], "-p", " Next", "-p", " Then", "-n", "6", "--provider", "cpu", "--state-in", path, "--json")
    assert second.exit_code == 0, second.stderr
    for r, before, after in zip(json.loads(second.stdout)["results"], ("One.", "Second one."), (" Next", " Then")):
        whole = list(before.encode()) + Generator(session, before, max_new_tokens=6).run().results[0].ids + list(after.encode())
        assert r["text"] == Generator(session, whole, max_new_tokens=6).run().text
    assert_one_line_error(invoke(tiny[1], "-p", "Hi", "-p", "Ho", "-p", "Ha", "--provider", "cpu", "--state-in", path),
                          "two.npz holds 2 sequence(s) but 3 are needed here")


def test_help_teaches_with_examples():
    result = invoke("--help")
    assert result.exit_code == 0
    for text in ("Examples:", "edgelin generate out/ --prompt", "--state-out", "--state-in", "--top-p", "--json"):
        assert text in result.output


@pytest.mark.parametrize(
    "args, match",
    [
        (["--temperature", "-1"], "temperature must be"),
        (["--top-p", "0"], "top_p must be a number in (0, 1]"),
        (["--top-p", "1.5"], "top_p must be a number in (0, 1]"),
        (["--top-k", "-2"], "top_k must be an integer >= 0"),
        (["--max-new-tokens", "-1"], "max_new_tokens must be"),
        (["--max-new-tokens", "10000000000"], "max_new_tokens must be"),
        (["--seed", "-3"], "seed must be"),
        (["--provider", "gpu"], "provider must be one of"),
        (["--threads", "0"], "threads must be"),
        (["--stop", ""], "stop sequences must be non-empty"),
    ],
    ids=["temp", "top_p-0", "top_p-big", "top_k", "max-neg", "max-huge", "seed", "provider", "threads", "stop"],
)
def test_bad_options_exit_2_with_one_line(tiny, args, match):
    assert_one_line_error(invoke(tiny[1], "--prompt", "Hi", "--provider", "cpu", *args), match)


def test_empty_prompt(tiny):
    assert_one_line_error(invoke(tiny[1], "--prompt", "", "--provider", "cpu"), "the prompt is empty")
    assert_one_line_error(invoke(tiny[1], "-p", "Hi", "-p", "", "--provider", "cpu"), "prompt 2 of 2 is empty")


def test_not_an_export(tmp_path):
    assert_one_line_error(invoke(tmp_path, "--prompt", "Hi"), "is not an edgelin export")
    assert_one_line_error(invoke(tmp_path / "missing", "--prompt", "Hi"), "is not a folder")


def test_a_manifest_of_another_version(export_copy):
    path = export_copy / "edgelin.json"
    path.write_text(path.read_text().replace('"edgelin/2"', '"edgelin/9"'))
    assert_one_line_error(invoke(export_copy, "--prompt", "Hi", "--provider", "cpu"), "format 'edgelin/9'")


def test_graphs_that_do_not_match_the_manifest(export_copy):
    path = export_copy / "edgelin.json"
    data = json.loads(path.read_text())
    data["states"][0]["dtype"] = "float16"
    path.write_text(json.dumps(sync_io(data)))
    assert_one_line_error(invoke(export_copy, "--prompt", "Hi", "--provider", "cpu"), "input 'state.0.S' is tensor(float)")


def test_a_state_file_of_another_model(tiny, exported, tmp_path):
    from edgelin.runtime import load

    path = load(exported("relu")[1], provider="cpu").new_state(1).save(tmp_path / "relu.npz")
    assert_one_line_error(invoke(tiny[1], "-p", "Hi", "--provider", "cpu", "--state-in", path), "saved from another model")


def test_a_state_file_of_another_batch_size(tiny, session, tmp_path):
    path = session.new_state(2).save(tmp_path / "two.npz")
    assert_one_line_error(invoke(tiny[1], "-p", "Hi", "--provider", "cpu", "--state-in", path), "holds 2 sequence(s) but 1")


def test_a_state_file_that_is_not_one(tiny, tmp_path):
    (tmp_path / "x.npz").write_text("hello")
    assert_one_line_error(invoke(tiny[1], "-p", "Hi", "--provider", "cpu", "--state-in", tmp_path / "x.npz"), "not an edgelin state file")


def test_state_out_in_a_missing_folder_writes_nothing(tiny, tmp_path):
    result = invoke(tiny[1], "-p", "Hi", "--provider", "cpu", "--state-out", tmp_path / "no" / "s.npz")
    assert_one_line_error(result, "folder does not exist")
    assert result.stdout == ""  # refused before generating anything


def test_cuda_without_cuda_is_one_line(tiny):
    from edgelin.runtime import load
    from edgelin.errors import ProviderError

    try:
        load(tiny[1], provider="cuda")
    except ProviderError:
        assert_one_line_error(invoke(tiny[1], "-p", "Hi", "--provider", "cuda"), "CUDA was requested but")
    else:  # a machine with a working GPU
        assert invoke(tiny[1], "-p", "Hi", "--provider", "cuda", "-n", "2").exit_code == 0


def test_auto_without_cuda_warns_in_one_line_and_runs(tiny):
    """A CPU run under --provider auto warns (one line) only where the machine shows a GPU CUDA could not use."""
    from edgelin.runtime.providers import gpu_visible

    result = invoke(tiny[1], "-p", "Hi", "-n", "3")
    assert result.exit_code == 0, result.stderr
    provider = result.stderr.strip().splitlines()[-1].split("]")[0].strip("[")
    warnings = [line for line in result.stderr.splitlines() if line.startswith("edgelin: warning:")]
    gpu_build = "CUDAExecutionProvider" in __import__("onnxruntime").get_available_providers()
    if provider == "cpu" and gpu_build and gpu_visible() is not False:
        assert len(warnings) == 1 and "CUDA is not active" in warnings[0]
    elif provider == "cpu":
        assert warnings == [], warnings
