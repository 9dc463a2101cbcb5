"""What every edgelin command shares: one-line errors with exit status 2, progress on stderr.

A module of its own so that command modules (cli_generate, cli_bench) and edgelin.cli can import it
in any order.
"""

from __future__ import annotations

import functools
import sys
from typing import NoReturn

import click

from edgelin.errors import EdgelinError

EXIT_BAD_INPUT = 2


def fail(message: str) -> NoReturn:
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
