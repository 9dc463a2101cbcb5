"""``edgelin web``: an export as a static web site that generates text in the browser (ONNX Runtime Web, WASM).

    write_site("out/", "site/", ort_web="node_modules/onnxruntime-web")   # -> SiteResult
    serve("site/", port=8000)                                             # http://127.0.0.1:8000/

The site holds ``index.html``, the JavaScript runtime ``edgelin.mjs``, the export (``export/``, with an
edgelin/2 manifest: an edgelin/1 export is upgraded on the way; with its golden outputs ``golden.json`` where
it has them, which the page checks itself against when opened with ``?check=1``; with its Hugging Face tokenizer
files where it has one) and the ONNX Runtime Web files (``ort/``), copied from an installed npm package
``onnxruntime-web`` (and, for a Hugging Face tokenizer, ``tok/tokenizers.mjs`` from ``@huggingface/tokenizers``):
nothing is fetched from the internet when the page runs. A file ``.edgelin-site`` records the sha256 of every file edgelin wrote, so ``--force``
replaces only a folder that is empty or a site edgelin made and nobody changed since. Standard library + the runtime only (no torch).
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from edgelin.errors import ManifestError, OutputError, RuntimeInputError
from edgelin.runtime.files import (
    MAX_RECOGNISED_BYTES, WORK_MARKER, check_output_dir, check_path, file_sha256, read_regular, remove_created, remove_stale_temps, replace_dir,
    temp_dir, uninterrupted, work_dir, work_files, write_failure,
)
from edgelin.runtime.check import embedded_problems, graph_manifest_text
from edgelin.runtime.golden import GOLDEN_FILE, Golden
from edgelin.runtime.manifest import GRAPHS, MANIFEST_FILE, Manifest, absent, join_problems

MODULE = "edgelin.mjs"
PAGE = "index.html"
MARKER = ".edgelin-site"
ORT_FILES = ("ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")
ORT_PACKAGE = "onnxruntime-web"
ORT_ENV = "EDGELIN_ORT_WEB"
TOK_PACKAGE = "@huggingface/tokenizers"  # for an export whose tokenizer is a Hugging Face tokenizer.json
TOK_FILE = "tokenizers.min.mjs"
TOK_SITE = "tok/tokenizers.mjs"  # where the page imports it from
TOK_ENV = "EDGELIN_TOKENIZERS_JS"
MIME = {".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm", ".json": "application/json",
        ".onnx": "application/octet-stream", ".data": "application/octet-stream", ".html": "text/html; charset=utf-8"}


def web_dir() -> Path:
    """The folder of the JavaScript runtime and the page template, installed or in a checkout."""
    from edgelin import runtime

    return Path(runtime.__file__).resolve().parent / "web"


@dataclass(frozen=True)
class NpmPackage:
    """An npm package a site copies files from: where to look (an option, an environment variable) and which version to
    install."""
    name: str
    files: tuple[str, ...]
    env: str
    option: str
    version: str


ORT_NPM = NpmPackage(ORT_PACKAGE, ORT_FILES, ORT_ENV, "--ort-web", "1.31.1")
TOK_NPM = NpmPackage(TOK_PACKAGE, (TOK_FILE,), TOK_ENV, "--tokenizers-js", "0.2.0")


def find_npm_packages(wanted: list[tuple[NpmPackage, str | os.PathLike | None]]) -> list[Path]:
    """The ``dist`` folder of each (package, the path given for it) (``_find_npm``); every package that is missing named
    in one RuntimeInputError, with one `npm install` command for them all."""
    found = [(package, given, _find_npm(package, given)) for package, given in wanted]
    missing = [(p, g) for p, g, dist in found if dist is None]
    if missing:
        one = len(missing) == 1
        names = " and ".join(p.name for p, _ in missing)
        install = " ".join(f"{p.name}@{p.version}" for p, _ in missing)
        where = "; ".join(("" if one else f"{p.name}: ") + _npm_where(p, g) for p, g in missing)
        options = " and ".join(f"{p.option} node_modules/{p.name} (or set {p.env})" for p, _ in missing)
        raise RuntimeInputError(f"{names} {'is' if one else 'are'} not installed ({where}); install {'it' if one else 'them'} once with "
                                f"`npm install {install}` and pass {options}")
    return [dist for _, _, dist in found]


def _npm_where(package: NpmPackage, given) -> str:
    """Where ``_find_npm`` looked for the package."""
    return str(given) if given is not None else os.environ.get(package.env) or "node_modules/ in this folder or above"


def _find_npm(package: NpmPackage, given) -> Path | None:
    """The ``dist`` folder of an installed npm ``package`` that holds its files: ``given`` (the package or its dist
    folder), else $``env``, else ``node_modules/PACKAGE`` in the current folder or one above it, else in the edgelin
    checkout; None where none holds them."""
    candidates = []
    if given is not None:
        candidates.append(Path(given))
    elif os.environ.get(package.env):
        candidates.append(Path(os.environ[package.env]))
    else:
        here = Path.cwd().resolve()
        candidates += [p / "node_modules" / package.name for p in (here, *here.parents)]
        candidates.append(Path(__file__).resolve().parent.parent / "node_modules" / package.name)
    for c in candidates:
        for dist in (c / "dist", c):
            if all((dist / f).is_file() for f in package.files):
                return dist
    return None


def find_ort_web(given: str | os.PathLike | None = None) -> Path:
    """The ``dist`` folder of an installed onnxruntime-web (``given``, $EDGELIN_ORT_WEB or node_modules)."""
    return find_npm_packages([(ORT_NPM, given)])[0]


def find_tokenizers_js(given: str | os.PathLike | None = None) -> Path:
    """The ``dist`` folder of an installed @huggingface/tokenizers (``given``, $EDGELIN_TOKENIZERS_JS or node_modules):
    what the page runs a Hugging Face tokenizer.json with."""
    return find_npm_packages([(TOK_NPM, given)])[0]


def site_files(folder: Path) -> list[str] | str:
    """The files of ``folder`` if it is a site ``edgelin web`` wrote and nothing in it changed since: its marker
    records the sha256 of every file, and the folder holds exactly those files with those hashes. Otherwise
    the reason, naming the first file that is not edgelin's (e.g. an index.html edited by hand)."""
    data = read_regular(folder / MARKER, MAX_RECOGNISED_BYTES, "site record", quiet=True)
    try:
        listed = json.loads(data.decode("utf-8")) if data is not None else None
    except (ValueError, RecursionError):
        listed = None
    if not isinstance(listed, dict) or not isinstance(listed.get("files"), dict):
        return f"it has no record of the files edgelin web wrote ({MARKER} with their sha256)"
    present = []
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            return f"{rel} is a symbolic link"
        if p.is_dir():
            continue
        if rel == MARKER:
            present.append(rel)
            continue
        want = listed["files"].get(rel)
        if want is None:
            return f"{rel} is not a file edgelin web wrote"
        if not p.is_file():
            return f"{rel} is not a regular file"
        try:
            if file_sha256(p) != want:
                return f"{rel} changed since edgelin web wrote it (sha256 differs)"
        except OSError as exc:
            return f"{rel} cannot be read: {exc.strerror or exc}"
        present.append(rel)
    return present


SITE_ENTRIES = frozenset({MODULE, PAGE, "export", "ort", Path(TOK_SITE).parts[0], MARKER})  # what a site's top level holds
SERVE_SCRATCH = "edgelin-web-serve"  # `edgelin web --serve` without -o: .edgelin-web-serve.tmp.PID.* in the temp folder


def _no_links(folder: Path) -> bool:
    return not any(p.is_symlink() for p in folder.rglob("*"))


def site_work(folder: Path, name: str) -> bool:
    """A killed ``edgelin web``'s work folder holds only a site's own entries (a ``.old`` one: the site ``name``)."""
    top = {e.name for e in folder.iterdir()} - {WORK_MARKER}
    return (top <= SITE_ENTRIES or top == {name}) and _no_links(folder)


def serve_scratch(folder: Path, name: str) -> bool:
    """A killed ``edgelin web --serve``'s temporary folder holds its site (or the site's work folder) and nothing else."""
    entries = [e for e in folder.iterdir() if e.name != WORK_MARKER]
    return all(e.is_dir() and not e.is_symlink() and (e.name == "site" or e.name.startswith(".site.")) and site_work(e, "site")
               for e in entries)


def serve_dir() -> Path:
    """A new temporary folder for ``edgelin web --serve`` without -o, after removing those a killed one left."""
    import tempfile

    root = Path(tempfile.gettempdir())
    remove_stale_temps(root, SERVE_SCRATCH, serve_scratch)
    return temp_dir(root, SERVE_SCRATCH)


# A node type onnxruntime-web's WASM backend runs slowly. Measured (random-init LFM2-350M, onnxruntime-web 1.31.1
# under node, 2 threads; README, "In the browser"): decode 3-4 tokens/s with int8 blocks and int4, against 26 at
# fp32, 27 with per-channel int8 and an fp32 table, 11 with an int8 table. ONNX Runtime's n-bit GEMM kernels (MLAS)
# are built for x86-64 and ARM64; the WASM decode costs about what widening every weight to fp32 on every call would
# (not traced further).
WASM_SLOW_OP = b"MatMulNBits"
WASM_NOTE = ("note: the graphs hold {op} nodes (block-quantised weights), which onnxruntime-web's WASM backend runs "
             "slowly: decode several times slower there than at fp32 (README, 'In the browser'); for a browser export fp32 "
             "where memory allows, or --precision int8 --int8-scheme channel --embedding fp32, and check that one with "
             "edgelin validate (per-channel int8 is less accurate on trained hybrids)")


def holds_op(graph: str | os.PathLike, op_type: bytes, chunk: int = 1 << 24) -> bool:
    """True when the ONNX file ``graph`` has a node of type ``op_type``: its NodeProto.op_type field (number 4, a
    length-prefixed string: tag 0x22, then the length) holding exactly those bytes. Read in pieces (a graph without
    an external-data file holds its weights too), no ONNX package needed."""
    if not 0 < len(op_type) < 128:
        raise ValueError(f"op_type must be 1..127 bytes (a one-byte length), got {len(op_type)}")
    needle = b"\x22" + bytes([len(op_type)]) + op_type
    seen = b""  # the last len(needle) - 1 bytes read: a match may straddle two pieces
    with open(graph, "rb") as f:
        while piece := f.read(chunk):
            window = seen + piece
            if needle in window:
                return True
            seen = window[-(len(needle) - 1):]
    return False


@dataclass
class SiteResult:
    out_dir: Path
    files: dict[str, int]  # relative path -> bytes
    manifest: Manifest
    upgraded: bool  # the export was edgelin/1 and its manifest was upgraded in the site
    wasm_slow: bool = False  # the graphs hold WASM_SLOW_OP nodes

    def summary(self) -> str:
        total = sum(self.files.values())
        lines = [f"wrote {self.out_dir} ({len(self.files)} files, {total / 1e6:.1f} MB)"]
        if self.upgraded:
            lines.append("  the export's edgelin/1 manifest was upgraded to edgelin/2 in the site")
        lines.append(f"  state per sequence: {self.manifest.state_summary()}")
        if self.manifest.tokenizer.get("kind") == "ids":  # said at build, not only when the page is asked for text
            lines.append("  note: this export has no text tokenizer (tokenizer kind 'ids'): the page takes and prints token ids only; "
                         "re-export with --tokenizer TOK/ (a Hugging Face tokenizer.json) for text")
        if self.wasm_slow:
            lines.append("  " + WASM_NOTE.format(op=WASM_SLOW_OP.decode()))
        lines.append("  serve it with any static web server (or `edgelin web EXPORT -o SITE --serve`) and open its index.html")
        lines.append("  automation: index.html?prompt=TEXT&n=N generates N tokens greedily at load; #output holds the text")
        if self.manifest.extra.get("golden") is not None:
            lines.append("  index.html?check=1 checks the page's ONNX Runtime against the export's golden outputs at load; #check holds the result")
        return "\n".join(lines)


def _check_export(export_dir: Path) -> Manifest:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an edgelin/1 export is upgraded in the site; the summary says so
        m = Manifest.load(export_dir)
    for g in GRAPHS:
        if not m.graph_path(export_dir, g).is_file():
            raise ManifestError(f"{absent(m.graph_path(export_dir, g), m.graphs[g], str(export_dir))}, the {g} graph named in {MANIFEST_FILE}; re-export the model")
    problems = m.file_problems(export_dir)
    if problems:
        raise ManifestError(f"{export_dir}: {join_problems(problems)}")
    # the graphs carry the manifest they were exported with: an edgelin.json edited since (states paired otherwise,
    # another eos id) or a graph of another export (its hash put in edgelin.json) would make a site that runs garbage
    problems = [p for g in GRAPHS for p in embedded_problems(m.graphs[g], graph_manifest_text(m.graph_path(export_dir, g)), m, "source")]
    if problems:
        raise ManifestError(f"{export_dir}: the graphs do not match {MANIFEST_FILE}: {'; '.join(problems)}")
    Golden.load(export_dir, m)  # golden.json, where the manifest names it: present, unchanged, readable (ManifestError)
    for name, digest in _tokenizer_files(m).items():
        path = export_dir / name
        if not path.is_file():
            raise ManifestError(f"{absent(path, name, str(export_dir))}, a tokenizer file named in {MANIFEST_FILE}; copy the whole export folder, or re-export the model")
        if file_sha256(path) != digest:
            raise ManifestError(f"{path} is not the file {MANIFEST_FILE} describes (its sha256 differs); re-export the model")
    return m


def _tokenizer_files(m: Manifest) -> dict[str, str]:
    """The tokenizer files of a Hugging Face tokenizer (name -> sha256), as the manifest lists them; {} for bytes/ids."""
    from edgelin.runtime.tokenizer import HUGGINGFACE

    spec = m.tokenizer or {}
    files = spec.get("files") if spec.get("kind") == HUGGINGFACE else None
    if not files:
        return {}
    for name in files:
        if not isinstance(name, str) or Path(name).name != name or name.startswith("."):
            raise ManifestError(f"{MANIFEST_FILE} names the tokenizer file {name!r}; it must be a plain file name in the export folder")
    return dict(files)


def write_site(
    export_dir: str | os.PathLike, out_dir: str | os.PathLike, *, ort_web: str | os.PathLike | None = None,
    force: bool = False, progress: Callable[[str], None] | None = None, tokenizers_js: str | os.PathLike | None = None,
) -> SiteResult:
    """Write the static site of ``export_dir`` to ``out_dir`` (built beside it, moved into place when complete). An
    export with a Hugging Face tokenizer gets its tokenizer files and @huggingface/tokenizers (``tokenizers_js``)."""
    say = progress or (lambda _m: None)
    export_dir, out = check_path(export_dir, "export folder", ManifestError), check_path(out_dir, "site folder", OutputError)
    manifest = _check_export(export_dir)
    tokenizer_files = _tokenizer_files(manifest)
    dist, tok_dist = (find_npm_packages([(ORT_NPM, ort_web)] + ([(TOK_NPM, tokenizers_js)] if tokenizer_files else [])) + [None])[:2]
    check = dict(force=force, protect=(export_dir,), ours=site_files, kind="a site written by edgelin web", protected="the export")
    replacing = check_output_dir(out, what="site folder", **check)
    for stale in remove_stale_temps(out.parent if str(out.parent) else Path("."), out.name, site_work):
        say(f"removed {stale}, left by an earlier edgelin web that was killed")
    source = web_dir()
    for name in (MODULE, PAGE):
        if not (source / name).is_file():
            raise OutputError(f"this install lacks {source / name}; reinstall edgelin")
    tmp, created = work_dir(out)
    try:
        say(f"copying the export and onnxruntime-web ({dist}) ...")
        shutil.copyfile(source / MODULE, tmp / MODULE)
        shutil.copyfile(source / PAGE, tmp / PAGE)
        (tmp / "export").mkdir()
        for g in GRAPHS:
            shutil.copyfile(manifest.graph_path(export_dir, g), tmp / "export" / manifest.graphs[g])
        if manifest.weights is not None:  # fetched once by the page, handed to both sessions
            shutil.copyfile(manifest.weights_path(export_dir), tmp / "export" / manifest.weights["file"])
        if manifest.extra.get("golden") is not None:  # fetched by the page's check (?check=1): Model.check()
            shutil.copyfile(export_dir / GOLDEN_FILE, tmp / "export" / GOLDEN_FILE)
        for name in tokenizer_files:  # tokenizer.json (what the page reads) and its companions, as the manifest lists them
            shutil.copyfile(export_dir / name, tmp / "export" / name)
        if tok_dist is not None:
            (tmp / TOK_SITE).parent.mkdir()
            shutil.copyfile(tok_dist / TOK_FILE, tmp / TOK_SITE)
        site_manifest = manifest if manifest.sha256 is not None else manifest.with_hashes(tmp / "export")
        (tmp / "export" / MANIFEST_FILE).write_text(site_manifest.to_json(), encoding="utf-8")
        (tmp / "ort").mkdir()
        for f in ORT_FILES:
            shutil.copyfile(dist / f, tmp / "ort" / f)
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in work_files(tmp)}
        record = {"format": "edgelin-site/1", "files": {f: file_sha256(tmp / f) for f in sorted(files)}}  # how --force tells a site edgelin wrote
        (tmp / MARKER).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        if replacing:
            say(f"replacing {out}: {replacing}")
        replace_dir(tmp, out, **check)
    except BaseException as exc:
        full = write_failure(exc, tmp)  # before the files go: their sizes tell a file-size limit
        with uninterrupted():  # a second Ctrl-C does not leave the work folder half removed
            shutil.rmtree(tmp, ignore_errors=True)
            clean = not tmp.exists() and remove_created(created)
        if isinstance(exc, OSError) and not isinstance(exc, OutputError):  # the file system's: one line, not a traceback
            left = "nothing was written" if clean else f"remove {tmp} by hand"
            why = full or (exc.strerror or str(exc))
            raise OutputError(f"cannot write the site {out}: {why}; make room (or choose another folder) and run again; {left}") from None
        raise
    slow = any(holds_op(out / "export" / manifest.graphs[g], WASM_SLOW_OP) for g in GRAPHS)
    return SiteResult(out, files, site_manifest, upgraded=manifest.read_from != site_manifest.format, wasm_slow=slow)


class _Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, **MIME}

    def log_message(self, format, *args):  # noqa: A002 -- the base class's name
        pass


def check_port(port: int) -> None:
    """Refuse a port that cannot be served on before anything is written: bound on 127.0.0.1 as the server binds
    it (address reuse on) and released at once. Port 0 (any free port) always passes."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            raise RuntimeInputError(f"cannot serve on 127.0.0.1:{port}: {exc.strerror or exc}; choose another --port") from None


def make_server(site: str | os.PathLike, port: int = 8000, handler: type = _Handler) -> http.server.ThreadingHTTPServer:
    """An HTTP server of ``site`` on 127.0.0.1 (port 0: any free port). Call serve_forever() on it."""
    site = Path(site)
    if not (site / PAGE).is_file():
        raise RuntimeInputError(f"{site} has no {PAGE}; write the site with `edgelin web EXPORT -o {site}` first")
    try:
        return http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(handler, directory=str(site)))
    except OSError as exc:
        raise RuntimeInputError(f"cannot serve on 127.0.0.1:{port}: {exc.strerror or exc}; choose another --port") from None


def serve_in_thread(site: str | os.PathLike, port: int = 0, handler: type = _Handler) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve ``site`` from a daemon thread; returns (server, base URL). ``server.shutdown()`` stops it."""
    server = make_server(site, port, handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


HEADLESS_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def open_headless(chromium: str, site: str | os.PathLike, query: dict, profile: str | os.PathLike, timeout: float = 240.0) -> dict | None:
    """Open the site's page in headless Chromium with ``query`` (e.g. prompt, n, check) and ``report``: the page
    posts its report ({state, output, decodeTokensPerS, ...}) to this server when done; returns it, or None when
    nothing came within ``timeout`` seconds (or Chromium exited first). Chromium's temporary folder is removed when
    it has exited. Tests and scripts/tokenizer_speed.py use it."""
    import subprocess
    import tempfile
    import time
    import urllib.parse

    got: dict = {}

    class Handler(_Handler):
        def do_POST(self):
            got["report"] = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            self.send_response(204)
            self.end_headers()

    # Chromium makes a folder of its own in TMPDIR at each start (org.chromium.Chromium.XXXXXX, its singleton socket
    # inside) and, stopped by a kill, leaves it there: its TMPDIR is a folder of ours, removed once it has exited
    # (a short path: a Unix socket's path holds at most 107 bytes)
    scratch = Path(tempfile.mkdtemp(prefix="edgelin-chromium-"))
    try:
        server, base = serve_in_thread(site, 0, Handler)
        try:
            url = base + PAGE + "?" + urllib.parse.urlencode({**query, "report": "/__report"})
            proc = subprocess.Popen([chromium, *HEADLESS_FLAGS, f"--user-data-dir={profile}", url], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env={**os.environ, "TMPDIR": str(scratch)})
            try:
                start = time.monotonic()
                while "report" not in got and proc.poll() is None and time.monotonic() - start < timeout:
                    time.sleep(0.1)
            finally:
                proc.kill()
                proc.wait()
        finally:
            server.shutdown()
            server.server_close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return got.get("report")


__all__ = ["HEADLESS_FLAGS", "SiteResult", "WASM_NOTE", "WASM_SLOW_OP", "check_port", "find_ort_web", "find_tokenizers_js",
           "holds_op", "make_server", "open_headless", "serve_in_thread", "site_files", "write_site"]
