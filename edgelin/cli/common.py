"""What every edgelin command shares: one-line errors with exit status 2, progress on stderr.

Every command module imports it; it imports none of them.
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import sys
import threading
from typing import NoReturn

import click

from edgelin.errors import EdgelinError

EXIT_BAD_INPUT = 2


def fail(message: str) -> NoReturn:
    click.echo(f"edgelin: error: {message}", err=True)
    sys.exit(EXIT_BAD_INPUT)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so that cleanup (``finally``, temporary folders) runs as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# the signals that stop a command as Ctrl-C does: SIGTERM (kill, a service manager) and, where there is one,
# SIGHUP (the terminal closed)
STOPPING = (signal.SIGTERM,) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())


def _terminate(signum, _frame):
    raise Terminated(signum)


_QUIET_EXIT: list[bool] = []


def _quiet_exit() -> None:
    """After an interruption the program exits: a further Ctrl-C while the interpreter runs its exit handlers (torch's,
    onnx's: registered earlier, so run after this one) would print "Exception ignored in atexit callback" and a
    traceback. Ignore SIGINT from the first exit handler on (registered once, here, so that it runs first)."""
    if not _QUIET_EXIT:
        _QUIET_EXIT.append(True)
        atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)


def user_errors(fn):
    """Turn the library's typed errors (and Ctrl-C, SIGTERM) into one line and a non-zero exit, never a traceback.

    While the command runs, SIGTERM and SIGHUP raise ``Terminated`` (a KeyboardInterrupt): the library cleans
    up what it was writing, exactly as for Ctrl-C, and the exit status is 128 + the signal number.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        main_thread = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.signal(sig, _terminate) for sig in STOPPING} if main_thread else {}
        try:
            given = kwargs.get("export_dir")
            if isinstance(given, str) and not given.strip():  # a Path would read '' as '.', the current folder
                fail(f"EXPORT_DIR is {given!r}, an empty name; pass an export folder (the one holding edgelin.json)")
            return fn(*args, **kwargs)
        except EdgelinError as exc:
            fail(str(exc))
        except KeyboardInterrupt as exc:
            signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
            _quiet_exit()
            click.echo(f"edgelin: interrupted ({signal.Signals(signum).name}); nothing half-written was left", err=True)
            sys.exit(128 + int(signum))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    return wrapper


class _Stdout:
    """Standard output whose write errors are a user's problem to fix, said in one line: a full disk (ENOSPC),
    a reader that went away (EPIPE). After one, fd 1 points at /dev/null, so nothing more fails at exit."""

    def __init__(self, stream):
        self._stream = stream

    def _failed(self, exc: OSError):
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        if isinstance(exc, BrokenPipeError):
            raise EdgelinError("standard output was closed by the program reading it") from None
        raise EdgelinError(f"cannot write to standard output: {exc.strerror or exc}; free space where it goes, "
                           "or send it elsewhere") from None

    def write(self, text):
        if not text:  # click probes a stream with empty writes and handles what they raise itself
            return self._stream.write(text)
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._failed(exc)

    def flush(self):
        try:
            return self._stream.flush()
        except OSError as exc:
            self._failed(exc)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class OneLineGroup(click.Group):
    """A click group whose usage errors (unknown option, bad value, missing argument) read like every
    other error: one line, ``edgelin: error: ...``, exit status 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            os.getcwd()
        except OSError as exc:  # relative paths would be resolved against it
            fail(f"the current folder cannot be read ({exc.strerror}; was it deleted?): cd to a folder that exists and run edgelin again")
        if sys.stdout is None:  # started with fd 1 closed
            fail("standard output is closed; give edgelin somewhere to write (the terminal, a file or a pipe)")
        stdout, sys.stdout = sys.stdout, _Stdout(sys.stdout)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except EdgelinError as exc:  # raised outside a command's own handler (e.g. writing its last output)
            fail(str(exc))
        except click.exceptions.NoArgsIsHelpError as exc:  # `edgelin` alone: the help, as --help prints it
            click.echo(exc.ctx.get_help(), err=True)
            sys.exit(EXIT_BAD_INPUT)
        except click.exceptions.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "edgelin"
            fail(f"{' '.join(exc.format_message().split())} (see `{where} --help`)")
        except click.exceptions.ClickException as exc:
            fail(" ".join(exc.format_message().split()))
        except click.exceptions.Abort:
            click.echo("edgelin: interrupted", err=True)
            sys.exit(128 + int(signal.SIGINT))
        finally:
            sys.stdout = stdout
        sys.exit(rv if isinstance(rv, int) else 0)


def progress(message: str) -> None:
    """Progress lines go to stderr, so stdout stays clean for results."""
    click.echo(message, err=True)


BUDGET_HELP = ("A parity bound of your own, KIND.BOUND=VALUE (repeatable), e.g. logits.max_rel=3e-5: kinds logits, state, "
               "provider, long, top1, greedy, heldout; bounds max_abs, max_rel (max abs / max(1, max |reference|)), rel_l2, "
               "min_agreement, max_bpb_delta. See docs/parity.md.")
