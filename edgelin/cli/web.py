"""``edgelin web``: write (and optionally serve) a static site that runs an export in the browser (torch-free)."""

from __future__ import annotations

import shutil

import click

from edgelin.cli.common import progress, user_errors


@click.command("web", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("export_dir", type=click.Path(path_type=str))
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Folder to write the site to (must not exist unless --force). Required unless --serve.")
@click.option("--force", is_flag=True, help="Replace OUT if it is empty or a site edgelin web wrote; any other folder is refused.")
@click.option("--ort-web", type=click.Path(path_type=str), default=None,
              help="The installed npm package onnxruntime-web [default: $EDGELIN_ORT_WEB, else node_modules/onnxruntime-web here or above].")
@click.option("--tokenizers-js", type=click.Path(path_type=str), default=None,
              help="For an export with a Hugging Face tokenizer.json: the installed npm package @huggingface/tokenizers the page "
                   "runs it with [default: $EDGELIN_TOKENIZERS_JS, else node_modules/@huggingface/tokenizers here or above].")
@click.option("--serve", is_flag=True, help="Serve the site on 127.0.0.1 until Ctrl-C (a temporary folder without -o).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port for --serve, 0..65535 (0: any free port).")
@user_errors
def web(export_dir, out_dir, force, ort_web, tokenizers_js, serve, port):
    """Write a static web site that generates text from EXPORT_DIR in the browser (ONNX Runtime Web, WASM).

    The site holds index.html, the JavaScript runtime edgelin.mjs, the export and the ONNX Runtime Web
    files (and, for an export with a Hugging Face tokenizer, @huggingface/tokenizers); nothing is
    fetched from the internet when it runs. Open index.html?prompt=TEXT&n=N to
    generate N tokens greedily at load (the text lands in #output).

    In ONNX Runtime Web's WASM backend, an export with block-quantised weights (MatMulNBits nodes: int4,
    int8 blocks, an int8 or int4 table shared with the head) decodes several times slower than at fp32
    (measured: docs/performance.md). The summary says when the graphs hold them.

    \b
    Examples:
      edgelin web out/ -o site/
      edgelin web out/ --serve --port 8080
    """
    from edgelin.errors import RuntimeInputError
    from edgelin.web import check_port, make_server, serve_dir, write_site

    if out_dir is None and not serve:
        raise RuntimeInputError("name the site folder with -o SITE (or pass --serve to serve a temporary one)")
    if serve:  # a busy port is refused before the site is written
        check_port(port)
    scratch = None
    if out_dir is None:
        scratch = serve_dir()  # removed below; one a killed run left is removed by the next --serve
        out_dir = f"{scratch}/site"
    try:
        result = write_site(export_dir, out_dir, ort_web=ort_web, force=force, progress=progress, tokenizers_js=tokenizers_js)
        click.echo(result.summary())
        if serve:
            server = make_server(out_dir, port)
            click.echo(f"serving {out_dir} on http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C stops)")
            try:
                server.serve_forever()
            finally:
                server.server_close()
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
