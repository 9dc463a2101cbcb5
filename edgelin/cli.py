"""The ``edgelin`` command line: a thin layer over the library, one library function per command.

Errors a user can fix (``EdgelinError``) print one line, ``edgelin: error: ...``, and exit with status 2.
torch is imported lazily, inside the commands that need it.
"""

from __future__ import annotations

import functools
import sys

import click

from edgelin import __version__
from edgelin.errors import EdgelinError

EXIT_BAD_INPUT = 2


def fail(message: str) -> "NoReturn":  # noqa: F821
    click.echo(f"edgelin: error: {message}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def user_errors(fn):
    """Turn the library's typed errors (and Ctrl-C) into one line and a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except EdgelinError as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            click.echo("edgelin: interrupted", err=True)
            sys.exit(130)

    return wrapper


def progress(message: str) -> None:
    """Progress lines go to stderr, so stdout stays clean for results."""
    click.echo(message, err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="edgelin")
def main() -> None:
    """Deploy linear-attention language models with ONNX.

    \b
    A typical session:
      edgelin export CHECKPOINT -o out/      # two ONNX graphs (prefill + decode) + edgelin.json
      edgelin generate out/ --prompt "Hi"    # stream tokens from ONNX Runtime

    Every command has --help.
    """


if __name__ == "__main__":  # pragma: no cover
    main()
