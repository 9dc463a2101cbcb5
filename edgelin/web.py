"""``edgelin web``: an export as a static web site that generates text in the browser (ONNX Runtime Web, WASM).

    write_site("out/", "site/", ort_web="node_modules/onnxruntime-web")   # -> SiteResult
    serve("site/", port=8000)                                             # http://127.0.0.1:8000/

The site holds ``index.html``, the JavaScript runtime ``edgelin.mjs``, the export (``export/``, with an
edgelin/2 manifest: an edgelin/1 export is upgraded on the way; with its golden outputs ``golden.json`` where
it has them, which the page checks itself against when opened with ``?check=1``) and the ONNX Runtime Web files
(``ort/``), copied from an installed npm package ``onnxruntime-web``: nothing is fetched from the internet
when the page runs. A file ``.edgelin-site`` records the sha256 of every file edgelin wrote, so ``--force``
replaces only a folder that is empty or a site edgelin made and nobody changed since. Standard library + the runtime only (no torch).
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from edgelin.errors import ManifestError, OutputError, RuntimeInputError
from edgelin.runtime.files import MAX_RECOGNISED_BYTES, check_output_dir, file_sha256, read_regular, remove_created, replace_dir, work_dir
from edgelin.runtime.golden import GOLDEN_FILE, Golden
from edgelin.runtime.manifest import GRAPHS, MANIFEST_FILE, Manifest

MODULE = "edgelin.mjs"
PAGE = "index.html"
MARKER = ".edgelin-site"
ORT_FILES = ("ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")
ORT_PACKAGE = "onnxruntime-web"
ORT_ENV = "EDGELIN_ORT_WEB"
MIME = {".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm", ".json": "application/json",
        ".onnx": "application/octet-stream", ".data": "application/octet-stream", ".html": "text/html; charset=utf-8"}


def web_dir() -> Path:
    """The folder of the JavaScript runtime and the page template, installed or in a checkout."""
    from edgelin import runtime

    return Path(runtime.__file__).resolve().parent / "web"


def find_ort_web(given: str | os.PathLike | None = None) -> Path:
    """The ``dist`` folder of an installed onnxruntime-web: ``given`` (the package or its dist folder),
    else $EDGELIN_ORT_WEB, else ``node_modules/onnxruntime-web`` in the current folder or one above it,
    else in the edgelin checkout. RuntimeInputError saying how to install it when none is found."""
    candidates = []
    if given is not None:
        candidates.append(Path(given))
    elif os.environ.get(ORT_ENV):
        candidates.append(Path(os.environ[ORT_ENV]))
    else:
        here = Path.cwd().resolve()
        candidates += [p / "node_modules" / ORT_PACKAGE for p in (here, *here.parents)]
        candidates.append(Path(__file__).resolve().parent.parent / "node_modules" / ORT_PACKAGE)
    for c in candidates:
        for dist in (c / "dist", c):
            if all((dist / f).is_file() for f in ORT_FILES):
                return dist
    where = str(candidates[0]) if given is not None or os.environ.get(ORT_ENV) else "node_modules/ in this folder or above"
    raise RuntimeInputError(
        f"onnxruntime-web is not installed ({where}); install it once with `npm install {ORT_PACKAGE}@1.30.0` "
        f"and pass --ort-web node_modules/{ORT_PACKAGE} (or set {ORT_ENV})"
    )


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


@dataclass
class SiteResult:
    out_dir: Path
    files: dict[str, int]  # relative path -> bytes
    manifest: Manifest
    upgraded: bool  # the export was edgelin/1 and its manifest was upgraded in the site

    def summary(self) -> str:
        total = sum(self.files.values())
        lines = [f"wrote {self.out_dir} ({len(self.files)} files, {total / 1e6:.1f} MB)"]
        if self.upgraded:
            lines.append("  the export's edgelin/1 manifest was upgraded to edgelin/2 in the site")
        lines.append(f"  state per sequence: {self.manifest.state_bytes(1):,} bytes")
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
            raise ManifestError(f"{export_dir} lacks {m.graphs[g]}, the {g} graph named in {MANIFEST_FILE}; re-export the model")
    problems = m.file_problems(export_dir)
    if problems:
        raise ManifestError(f"{export_dir}: {'; '.join(problems)}")
    Golden.load(export_dir, m)  # golden.json, where the manifest names it: present, unchanged, readable (ManifestError)
    return m


def write_site(
    export_dir: str | os.PathLike, out_dir: str | os.PathLike, *, ort_web: str | os.PathLike | None = None,
    force: bool = False, progress: Callable[[str], None] | None = None,
) -> SiteResult:
    """Write the static site of ``export_dir`` to ``out_dir`` (built beside it, moved into place when complete)."""
    say = progress or (lambda _m: None)
    export_dir, out = Path(export_dir), Path(out_dir)
    manifest = _check_export(export_dir)
    dist = find_ort_web(ort_web)
    check = dict(force=force, protect=(export_dir,), ours=site_files, kind="a site written by edgelin web", protected="the export")
    replacing = check_output_dir(out, what="site folder", **check)
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
        site_manifest = manifest if manifest.sha256 is not None else manifest.with_hashes(tmp / "export")
        (tmp / "export" / MANIFEST_FILE).write_text(site_manifest.to_json(), encoding="utf-8")
        (tmp / "ort").mkdir()
        for f in ORT_FILES:
            shutil.copyfile(dist / f, tmp / "ort" / f)
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        record = {"format": "edgelin-site/1", "files": {f: file_sha256(tmp / f) for f in sorted(files)}}  # how --force tells a site edgelin wrote
        (tmp / MARKER).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        if replacing:
            say(f"replacing {out}: {replacing}")
        replace_dir(tmp, out, **check)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_created(created)
        raise
    return SiteResult(out, files, site_manifest, upgraded=manifest.read_from != site_manifest.format)


class _Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, **MIME}

    def log_message(self, format, *args):  # noqa: A002 -- the base class's name
        pass


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


__all__ = ["SiteResult", "find_ort_web", "make_server", "serve_in_thread", "site_files", "write_site"]
