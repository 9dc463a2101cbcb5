"""Nothing lost: every file edgelin writes is checked first, every graph it runs is the one the manifest names,
every file it reads is a regular file of bounded size. One table per class of fault.

CLI refusals must exit with status 2, print exactly one ``edgelin: error:`` line, no traceback, and leave the
folder tree exactly as it was. API refusals raise an ``EdgelinError`` subclass and change nothing either.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from click.testing import CliRunner

from edgelin.cli import main
from testkit.cli import Case
from testkit.files import tree
from edgelin.runtime.manifest import sync_io
from edgelin.errors import EdgelinError, OutputError


# ---- the world a case runs in ----------------------------------------------------------------------


def _session(w: Path):
    from edgelin.runtime import load

    return load(w / "export", provider="cpu")


def user_file(name: str, data: bytes = b"mine, not edgelin's\n"):
    def setup(w: Path) -> None:
        (w / name).parent.mkdir(parents=True, exist_ok=True)
        (w / name).write_bytes(data)

    return setup


def symlink(name: str, target: str):
    def setup(w: Path) -> None:
        os.symlink(target, w / name)

    return setup


def fifo(name: str):
    def setup(w: Path) -> None:
        os.mkfifo(w / name)

    return setup


def user_png(name: str):
    """A PNG that edgelin did not draw (a PNG signature and an IHDR chunk, no edgelin text chunk)."""
    return user_file(name, b"\x89PNG\r\n\x1a\n" + (13).to_bytes(4, "big") + b"IHDR" + bytes(13) + bytes(4))


def run_cli_case(world: Path, case: Case) -> None:
    if case.setup is not None:
        case.setup(world)
    before = tree(world)
    result = run_with_timeout(lambda: CliRunner().invoke(main, case.args), 60)
    text = result.output + result.stderr
    assert "Traceback" not in text, text
    assert isinstance(result.exception, SystemExit) or result.exception is None, repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("edgelin: error:")]
    assert len(errors) == 1, result.stderr
    assert case.expect in errors[0], errors[0]
    assert tree(world) == before


def run_with_timeout(fn, seconds: float):
    """fn() in a thread; fails the test (instead of hanging the run) if it has not returned in ``seconds``."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 -- re-raised in the test's thread
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"did not return within {seconds} s (blocked?)")
    if "error" in box:
        raise box["error"]
    return box["value"]


# ---- class 1: an output file is replaced only if edgelin wrote it -----------------------------------
GEN = ["generate", "export", "-p", "Hi", "-n", "2", "--provider", "cpu"]
FORCE = "--force"
WRITE_CASES = {
    # --state-out
    "state-out/user-file": Case(GEN + ["--state-out", "docs/thesis.txt"], "pass --force"),
    "state-out/user-npz": Case(GEN + ["--state-out", "mine.npz"], "not an edgelin state file", user_file("mine.npz", b"PK\x03\x04 not ours")),
    "state-out/export-graph": Case(GEN + ["--state-out", "export/decode.onnx"], "part of the edgelin export"),
    "state-out/export-manifest": Case(GEN + ["--state-out", "export/edgelin.json"], "part of the edgelin export"),
    "state-out/symlink-forced": Case(GEN + ["--state-out", "link.npz", FORCE], "symbolic link", symlink("link.npz", "docs/thesis.txt")),
    "state-out/symlink": Case(GEN + ["--state-out", "link.npz"], "symbolic link", symlink("link.npz", "docs/thesis.txt")),
    "state-out/fifo-forced": Case(GEN + ["--state-out", "pipe", FORCE], "not a regular file", fifo("pipe")),
    # validate --json
    "validate-json/user-file": Case(["validate", "export", "--checkpoint", "models/ckpt", "--json", "docs/thesis.txt"], "pass --force"),
    "validate-json/user-json": Case(["validate", "export", "--checkpoint", "models/ckpt", "--json", "r.json"], "not an edgelin validate report", user_file("r.json", b'{"mine": 1}\n')),
    "validate-json/bench-json": Case(["validate", "export", "--checkpoint", "models/ckpt", "--json", "r.json"], "not an edgelin validate report",
                                     user_file("r.json", b'{"format": "edgelin-bench/1"}\n')),
    "validate-json/export-manifest": Case(["validate", "export", "--checkpoint", "models/ckpt", "--json", "export/edgelin.json"], "part of the edgelin export"),
    "validate-json/symlink-forced": Case(["validate", "export", "--checkpoint", "models/ckpt", "--json", "l.json", FORCE], "symbolic link", symlink("l.json", "file.txt")),
    # bench --out
    "bench-out/user-bench-json": Case(["bench", "models/ckpt", "--out", "docs"], "not an edgelin bench report", user_file("docs/bench.json", b"{}\n")),
    "bench-out/validate-json-as-bench": Case(["bench", "models/ckpt", "--out", "docs"], "not an edgelin bench report",
                                             user_file("docs/bench.json", b'{"format": "edgelin-validate/1"}\n')),
    "bench-out/user-plot": Case(["bench", "models/ckpt", "--out", "docs"], "not a plot edgelin bench drew", user_png("docs/decode.png")),
    "bench-out/plot-folder": Case(["bench", "models/ckpt", "--out", "docs", FORCE], "is a folder", lambda w: (w / "docs" / "floor.png").mkdir()),
    "bench-out/into-export": Case(["bench", "models/ckpt", "--out", "export"], "not a plot", user_png("export/sweep.png")),
}


@pytest.mark.parametrize("name", [pytest.param(k, id=k) for k in WRITE_CASES])
def test_an_output_file_edgelin_did_not_write_is_refused(world, name):
    run_cli_case(world, WRITE_CASES[name])


def _api_write_cases():
    def state_over_user_file(w):
        _session(w).new_state(1).save(w / "docs" / "thesis.txt")

    def state_over_graph(w):
        _session(w).new_state(1).save(w / "export" / "prefill.onnx")

    def state_over_fifo(w):
        os.mkfifo(w / "pipe")
        _session(w).new_state(1).save(w / "pipe")

    def state_over_fifo_overwrite(w):
        os.mkfifo(w / "pipe")
        _session(w).new_state(1).save(w / "pipe", overwrite=True)

    def state_through_symlink(w):
        os.symlink("docs/thesis.txt", w / "s.npz")
        _session(w).new_state(1).save(w / "s.npz", overwrite=True)

    def generate_text_state_out(w):
        from edgelin.runtime import generate_text

        generate_text(w / "export", "Hi", max_new_tokens=2, provider="cpu", state_out=w / "file.txt")

    def report_over_user_file(w):
        from edgelin.validate import Report

        Report("export", "ckpt", "fp32", {"cpu": "active"}).write_json(w / "docs" / "thesis.txt")

    def checkpoint_over_user_config(w):
        from edgelin.checkpoint import load_checkpoint, save_checkpoint

        model = load_checkpoint(w / "models" / "ckpt")
        (w / "docs" / "config.json").write_text('{"mine": true}\n')
        save_checkpoint(model, w / "docs")

    def bench_json_over_user_file(w):
        from edgelin.bench.report import write_json_atomic

        write_json_atomic({"format": "edgelin-bench/1"}, w / "docs" / "thesis.txt")

    def write_json_over_export_manifest(w):
        from edgelin.runtime.files import write_json

        write_json(w / "export" / "edgelin.json", {"format": "edgelin/2"})

    def optimized_over_user_file(w):
        from edgelin.runtime import load

        (w / "docs" / "decode.optimized.onnx").write_text("mine\n")
        load(w / "export", provider="cpu", save_optimized=w / "docs")

    def optimized_into_a_file(w):
        from edgelin.runtime import load

        load(w / "export", provider="cpu", save_optimized=w / "file.txt")

    return {
        "session-save-optimized-over-user-file": optimized_over_user_file,
        "session-save-optimized-into-a-file": optimized_into_a_file,
        "state-save-user-file": state_over_user_file,
        "state-save-export-graph": state_over_graph,
        "state-save-fifo": state_over_fifo,
        "state-save-fifo-overwrite": state_over_fifo_overwrite,
        "state-save-symlink-overwrite": state_through_symlink,
        "generate-text-state-out-user-file": generate_text_state_out,
        "report-write-json-user-file": report_over_user_file,
        "save-checkpoint-user-config": checkpoint_over_user_config,
        "bench-json-user-file": bench_json_over_user_file,
        "write-json-export-manifest-even-same-format": write_json_over_export_manifest,
    }


API_WRITE_NAMES = list(_api_write_cases())


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in API_WRITE_NAMES])
def test_the_api_refuses_to_replace_what_edgelin_did_not_write(world, name):
    fn = _api_write_cases()[name]
    before = {k: v for k, v in tree(world).items()}
    with pytest.raises(OutputError) as info:
        run_with_timeout(lambda: fn(world), 30)
    assert "\n" not in str(info.value)
    after = tree(world)
    for k in ("docs/thesis.txt", "file.txt", "export/edgelin.json", "export/prefill.onnx", "export/decode.onnx"):
        assert after[k] == before[k], k
    assert not [k for k in after if ".tmp" in k], after


def test_files_edgelin_wrote_are_replaced_without_force(world):
    """A second --state-out, --json or bench run replaces its own earlier file: recognised by content."""
    from edgelin.bench.report import write_json_atomic
    from edgelin.checkpoint import load_checkpoint, save_checkpoint
    from edgelin.validate import Report

    for _ in range(2):
        r = CliRunner().invoke(main, GEN + ["--state-out", "chat.npz"])
        assert r.exit_code == 0, r.stderr
    report = Report("export", "ckpt", "fp32", {"cpu": "active"})
    report.write_json(world / "r.json")
    report.write_json(world / "r.json")
    assert json.loads((world / "r.json").read_text())["format"] == "edgelin-validate/1"
    write_json_atomic({"format": "edgelin-bench/1", "n": 1}, world / "bench.json")
    write_json_atomic({"format": "edgelin-bench/1", "n": 2}, world / "bench.json")
    model = load_checkpoint(world / "models" / "ckpt")
    save_checkpoint(model, world / "models" / "ckpt")  # its own earlier save
    from edgelin.runtime import load

    for _ in range(2):
        load(world / "export", provider="cpu", save_optimized=world / "opt")


def test_force_replaces_a_user_file(world):
    r = CliRunner().invoke(main, GEN + ["--state-out", "docs/thesis.txt", "--force"])
    assert r.exit_code == 0, r.stderr
    from edgelin.runtime.state import is_state_file

    assert is_state_file(world / "docs" / "thesis.txt")


def test_bench_plots_carry_the_mark_that_recognises_them(tmp_path):
    pytest.importorskip("matplotlib")
    from edgelin.bench.report import BENCH_PLOT

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edgelin.bench.report import PLOT_SOFTWARE
    from edgelin.runtime.files import atomic_write

    fig = plt.figure()
    atomic_write(tmp_path / "decode.png", lambda f: fig.savefig(f, format="png", metadata={"Software": PLOT_SOFTWARE}))
    fig.savefig(tmp_path / "other.png", format="png")
    plt.close(fig)
    assert BENCH_PLOT(tmp_path / "decode.png")
    assert not BENCH_PLOT(tmp_path / "other.png")


def test_the_plot_recogniser_reads_the_png_text_chunk(tmp_path):
    """A PNG whose tEXt chunk Software starts with "edgelin bench" (as the bench's savefig writes) is ours."""
    from edgelin.bench.report import BENCH_PLOT

    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + bytes(4)

    head = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", bytes(13))
    (tmp_path / "ours.png").write_bytes(head + chunk(b"tEXt", b"Software\0edgelin bench") + chunk(b"IDAT", b"x") + chunk(b"IEND", b""))
    (tmp_path / "theirs.png").write_bytes(head + chunk(b"tEXt", b"Software\0Matplotlib") + chunk(b"IDAT", b"x"))
    (tmp_path / "late.png").write_bytes(head + chunk(b"IDAT", b"x") + chunk(b"tEXt", b"Software\0edgelin bench"))
    assert BENCH_PLOT(tmp_path / "ours.png")
    assert not BENCH_PLOT(tmp_path / "theirs.png") and not BENCH_PLOT(tmp_path / "late.png")


# ---- class 3: the runtime runs only the graphs the manifest names -----------------------------------
def edit_manifest(fn: Callable[[dict], None]):
    def setup(w: Path) -> None:
        path = w / "export" / "edgelin.json"
        d = json.loads(path.read_text())
        fn(d)
        path.write_text(json.dumps(d, indent=2))

    return setup


def mispair_states(d: dict) -> None:
    """Swap the outputs of the first two states of equal shape: each present fed back as the other's input."""
    states = d["states"]
    for i, a in enumerate(states):
        for b in states[i + 1:]:
            if a["shape"] == b["shape"] and a["dtype"] == b["dtype"]:
                a["output"], b["output"] = b["output"], a["output"]
                sync_io(d)  # the manifest stays self-consistent: only the graphs' own copy can tell
                return
    raise AssertionError("no two states of equal shape")


def resave_graph(name: str):
    """The same graph, saved again with a doc string: valid, same inputs and outputs, other bytes."""
    def setup(w: Path) -> None:
        import onnx

        proto = onnx.load(str(w / "export" / name))
        proto.doc_string = "edited by hand"
        onnx.save(proto, str(w / "export" / name))

    return setup


def graph_from(other: Path, name: str):
    def setup(w: Path) -> None:
        shutil.copyfile(other / name, w / "export" / name)

    return setup


def int8_decode(w: Path) -> None:
    graph_from(INT8_EXPORT[0], "decode.onnx")(w)


INT8_EXPORT: list[Path] = []


@pytest.fixture
def int8_export(exported):
    INT8_EXPORT[:] = [exported("elu+1", options={"precision": "int8"})[1]]
    return INT8_EXPORT[0]


def _init(value):
    def fn(d):
        d["states"][0]["init"] = value

    return fn


GRAPH_CASES = {
    "decode-from-the-int8-export": Case(GEN, "sha256 differs", int8_decode),
    "prefill-resaved": Case(GEN, "sha256 differs", resave_graph("prefill.onnx")),
    "decode-resaved": Case(GEN, "sha256 differs", resave_graph("decode.onnx")),
    "states-mispaired": Case(GEN, "differs from the manifest the graph carries in states", edit_manifest(mispair_states)),
    "init-edited": Case(GEN, "differs from the manifest the graph carries in states", edit_manifest(_init(1e30))),
    "precision-edited": Case(GEN, "precision", edit_manifest(lambda d: d.update(precision="int8"))),
    "min-sequence-edited": Case(GEN, "min_sequence", edit_manifest(lambda d: d.update(min_sequence=2))),
}


@pytest.mark.parametrize("name", [pytest.param(k, id=k) for k in GRAPH_CASES])
def test_a_graph_the_manifest_does_not_name_is_refused(world, int8_export, name):
    run_cli_case(world, GRAPH_CASES[name])


def test_hash_check_can_be_skipped_and_the_structure_still_checked(world):
    from edgelin.errors import ManifestError
    from edgelin.runtime import load

    resave_graph("decode.onnx")(world)
    with pytest.raises(ManifestError, match="sha256 differs"):
        load(world / "export", provider="cpu")
    load(world / "export", provider="cpu", check_hashes=False)  # same structure, same embedded manifest
    edit_manifest(mispair_states)(world)
    with pytest.raises(ManifestError, match="differs from the manifest the graph carries in states"):
        load(world / "export", provider="cpu", check_hashes=False)


# ---- class 4: every file edgelin reads is a regular file of bounded size, checked before it is opened ----
def fifo_at(rel: str):
    """Replace the file at ``rel`` with a FIFO (a named pipe): opening it to read blocks until a writer comes."""
    def setup(w: Path) -> None:
        p = w / rel
        if p.exists():
            p.unlink()
        os.mkfifo(p)

    return setup


def release_fifos(root: Path) -> None:
    """Unblock any reader stuck opening a FIFO under ``root`` (a writer's open lets it through)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            if p.is_fifo():
                try:
                    os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass


READ_CASES = {
    "generate/state-in-fifo": Case(GEN + ["--state-in", "pipe"], "not a regular file", fifo_at("pipe")),
    "generate/manifest-fifo": Case(GEN, "edgelin.json", fifo_at("export/edgelin.json")),
    "generate/decode-graph-fifo": Case(GEN, "decode.onnx", fifo_at("export/decode.onnx")),
    "export/config-fifo": Case(["export", "models/ckpt", "-o", "out"], "config.json", fifo_at("models/ckpt/config.json")),
    "export/weights-fifo": Case(["export", "models/ckpt", "-o", "out"], "model.safetensors", fifo_at("models/ckpt/model.safetensors")),
    "export/tokenizer-fifo": Case(["export", "models/ckpt", "-o", "out", "--tokenizer", "pipe"], "pipe", fifo_at("pipe")),
    "validate/checkpoint-config-fifo": Case(["validate", "export", "--checkpoint", "models/ckpt"], "config.json", fifo_at("models/ckpt/config.json")),
    "web/graph-fifo": Case(["web", "export", "-o", "site"], "prefill.onnx", fifo_at("export/prefill.onnx")),
    "generate/manifest-1tib-sparse": Case(GEN, "a manifest is at most", lambda w: os.truncate(w / "export" / "edgelin.json", 1 << 40)),
    "generate/state-in-1tib-sparse": Case(GEN + ["--state-in", "big.npz"], "bytes", lambda w: (w / "big.npz").write_bytes(b"") or os.truncate(w / "big.npz", 1 << 40)),
}


@pytest.mark.parametrize("name", [pytest.param(k, id=k) for k in READ_CASES])
def test_a_file_that_is_not_a_regular_file_is_never_opened(world, name):
    try:
        run_cli_case(world, READ_CASES[name])
    finally:
        release_fifos(world)


def test_the_api_does_not_block_on_a_fifo_state(world):
    from edgelin.errors import RuntimeInputError

    os.mkfifo(world / "pipe")
    try:
        with pytest.raises(RuntimeInputError, match="not a regular file"):
            run_with_timeout(lambda: _session(world).load_state(world / "pipe"), 30)
    finally:
        release_fifos(world)


# ---- class 2: --force replaces only what edgelin wrote, recognised by content --------------------------
def export_folder_like(name: str, manifest: bytes, files: dict[str, bytes]):
    def setup(w: Path) -> None:
        (w / name).mkdir()
        (w / name / "edgelin.json").write_bytes(manifest)
        for f, data in files.items():
            (w / name / f).write_bytes(data)

    return setup


def append_to(rel: str, data: bytes):
    def setup(w: Path) -> None:
        with open(w / rel, "ab") as f:
            f.write(data)

    return setup


EXP_FORCE = ["export", "models/ckpt", "-o", "export", "--force"]
FORCE_CASES = {
    "export/user-json-in-export": Case(EXP_FORCE, "notes.json is not a file its edgelin.json names", user_file("export/notes.json", b'{"mine": 1}\n')),
    "export/user-onnx-in-export": Case(EXP_FORCE, "mine.onnx is not a file its edgelin.json names", user_file("export/mine.onnx", b"\x08\x07")),
    "export/user-data-in-export": Case(EXP_FORCE, "embeddings.data is not a file", user_file("export/embeddings.data", b"\x00" * 16)),
    "export/graph-edited-since": Case(EXP_FORCE, "decode.onnx is not the file its edgelin.json records", append_to("export/decode.onnx", b"\x00")),
    "export/manifest-only-starts-with-edgelin": Case(["export", "models/ckpt", "-o", "fake", "--force"], "records no graph hashes",
                                                    export_folder_like("fake", b'{"format": "edgelin/9"}', {"thesis.onnx": b"years of work"})),
    "export/manifest-names-a-user-file": Case(["export", "models/ckpt", "-o", "fake", "--force"], "thesis.onnx is not the file",
                                             export_folder_like("fake", json.dumps({"format": "edgelin/2", "graphs": {"prefill": "thesis.onnx"},
                                                                                    "sha256": {"prefill": "0" * 64}}).encode(), {"thesis.onnx": b"years of work"})),
    "demo/out-export-with-user-json": Case(["demo", "--out", "export"], "notes.json is not a file", user_file("export/notes.json", b"{}\n")),
}


@pytest.mark.parametrize("name", [pytest.param(k, id=k) for k in FORCE_CASES])
def test_force_replaces_only_files_edgelin_wrote(world, name):
    run_cli_case(world, FORCE_CASES[name])


def test_an_untouched_export_is_recognised_by_its_hashes(world):
    from edgelin.runtime.files import export_files

    assert export_files(world / "export") == sorted(os.listdir(world / "export"))
    (world / "export" / "notes.json").write_text("{}")
    assert "notes.json" in export_files(world / "export")


def test_web_force_refuses_a_site_whose_page_was_edited(world):
    from edgelin.web import find_ort_web, site_files, write_site

    try:
        ort_web = find_ort_web()
    except EdgelinError:
        pytest.skip("onnxruntime-web is not installed")
    write_site(world / "export", world / "site", ort_web=ort_web)
    assert isinstance(site_files(world / "site"), list)
    write_site(world / "export", world / "site", ort_web=ort_web, force=True)  # untouched: replaced
    (world / "site" / "index.html").write_text("<p>my own page</p>\n")
    before = tree(world)
    with pytest.raises(OutputError, match="index.html changed since edgelin web wrote it"):
        write_site(world / "export", world / "site", ort_web=ort_web, force=True)
    assert tree(world) == before


# ---- class 5: numbers at the edge ------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-300, 1e-200])
def test_a_tiny_temperature_samples_the_top_token_without_warnings(temperature):
    import warnings

    from edgelin.runtime.sampling import Sampler

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((3, 256)) * 5).astype(np.float32)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie at the top: shared
    for top_k, top_p in ((0, 1.0), (5, 1.0), (0, 0.9), (5, 0.5)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            probs = Sampler(temperature, top_k, top_p, seed=1).probs(logits)
        assert np.isfinite(probs).all()
        want = np.zeros_like(probs)
        want[0, logits[0].argmax()] = want[1, logits[1].argmax()] = 1.0
        if top_p > 0.5:
            want[2, [7, 9]] = 0.5
        else:  # the nucleus of a 0.5 / 0.5 tie at p = 0.5 is its first token (vocabulary order)
            want[2, 7] = 1.0
        np.testing.assert_array_equal(probs, want)


def test_generate_with_a_tiny_temperature_is_greedy(world):
    greedy = CliRunner().invoke(main, GEN[:-4] + ["-n", "12", "--provider", "cpu", "--json"])
    tiny = CliRunner().invoke(main, GEN[:-4] + ["-n", "12", "--provider", "cpu", "--json", "-t", "1e-310", "--seed", "3"])
    assert greedy.exit_code == 0 and tiny.exit_code == 0, (greedy.stderr, tiny.stderr)
    assert "Warning" not in tiny.stderr and "overflow" not in tiny.stderr
    assert json.loads(tiny.stdout)["ids"] == json.loads(greedy.stdout)["ids"]
