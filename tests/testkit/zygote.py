"""Warm starts for the oracles' subprocesses: a forking server per kind of oracle process.

The suite runs the frameworks' own models in processes of their own (``edgelin/upstream_run.py``,
``testkit/hf_oracle.py``): each such process hides packages before it imports transformers, patches modules for
float64, or makes Triton interpret fla's kernels, and none of that may reach the test process. A cold start of one
costs 3-5 s of imports (torch, transformers' modelling code, fla) for a model that then runs in well under a second;
the suite starts ~60 of them.

A ``Zygote`` is a process that did those imports once, with what the oracle script hides already hidden (its kind),
and then forks a child per request: the child points its standard streams at files, takes the caller's working
folder and environment, and runs the script as ``__main__`` (``runpy``), exactly as ``python SCRIPT ARGS`` would
in a process that had imported the same modules first. Every child starts from the zygote's state, so one run's
patches never reach the next. The zygote itself never runs a torch operation (its thread pools are not started
before a fork).

``Router`` stands in for ``subprocess.run`` in a test process: ``[sys.executable, SCRIPT, SPEC]`` for one of the two
scripts, output captured as text, goes to the zygote of its kind (hf_oracle.py; upstream_run.py by its spec's
framework) started with the caller's environment (one zygote per kind and environment). Anything else runs as a
real subprocess, and so does every oracle process outside the test processes (``edgelin validate`` run from the
CLI tests starts its own, cold).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

UPSTREAM_RUN = Path(__file__).resolve().parents[2] / "edgelin" / "upstream_run.py"
HF_ORACLE = Path(__file__).resolve().with_name("hf_oracle.py")
TRANSFORMERS_MODELS = ("lfm2", "qwen3_5", "qwen3_next", "mamba2", "bamba", "granitemoehybrid", "nemotron_h")

COMMON = ("torch", "transformers", "safetensors.torch")
MODELLING = COMMON + tuple(f"transformers.models.{m}.modeling_{m}" for m in TRANSFORMERS_MODELS)
# kind -> (what the kind's scripts hide before they import anything, the modules a zygote imports once)
KINDS = {
    "hf_oracle": (("fla",), MODELLING),
    "transformers": (("triton", "fla"), MODELLING),
    "fla": ((), COMMON + ("fla", "triton.runtime.interpreter")),
}
IGNORED_ENV = {"PYTEST_CURRENT_TEST"}  # changes per test; read by nothing an oracle runs


def kind_of(args) -> str | None:
    """The zygote kind that may run ``args`` (a subprocess argv), or None: hf_oracle.py, or upstream_run.py by the
    framework its spec names."""
    if not isinstance(args, (list, tuple)) or len(args) != 3 or str(args[0]) != sys.executable:
        return None
    script = Path(str(args[1])).resolve()
    if script == HF_ORACLE:
        return "hf_oracle"
    if script == UPSTREAM_RUN:
        try:
            framework = json.loads(Path(str(args[2])).read_text(encoding="utf-8"))["framework"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return {"fla": "fla", "transformers": "transformers"}.get(framework)
    return None


def env_key(env) -> tuple:
    """What a zygote's environment must equal for a caller's run: all of it but IGNORED_ENV."""
    return tuple(sorted((k, v) for k, v in (os.environ if env is None else env).items() if k not in IGNORED_ENV))


class Zygote:
    """One forking server of ``kind`` started with environment ``env``: ``run(argv, timeout=, cwd=)`` as
    subprocess.run(argv, capture_output=True, text=True, stdin=DEVNULL, env=env) would."""

    def __init__(self, kind: str, env: dict, folder: Path) -> None:
        self.kind, self.folder = kind, Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.log = self.folder / "zygote.err"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, __file__, kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, env=env, bufsize=0)
        self.lock = threading.Lock()
        self.replies = b""  # read from the zygote's stdout, not yet taken as lines
        self.count = 0

    def run(self, args, *, timeout: float | None, cwd=None) -> subprocess.CompletedProcess:
        with self.lock:
            self.count += 1
            out, err = self.folder / f"{self.count}.out", self.folder / f"{self.count}.err"
            request = {"argv": [str(a) for a in args[1:]], "cwd": str(cwd or os.getcwd()), "out": str(out), "err": str(err)}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            pid = int(self._line(600.0))  # the first request waits for the zygote's imports
            try:
                code = int(self._line(timeout))
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGKILL)
                self._line(30.0)  # the zygote reaps it and reports
                raise subprocess.TimeoutExpired(args, timeout) from None
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
            out.unlink()
            err.unlink()
            return subprocess.CompletedProcess(list(args), code, stdout, stderr)

    def _line(self, timeout: float | None) -> str:
        """The zygote's next reply line, read straight from the pipe (a buffered reader could hold a second reply
        that select() then never reports)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.replies:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                raise subprocess.TimeoutExpired("zygote", timeout)
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the {self.kind} zygote exited: {self.log.read_text()[-2000:]}")
            self.replies += chunk
        line, _, self.replies = self.replies.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Router:
    """subprocess.run with the oracle scripts' starts sent to warm zygotes (one per kind and environment, started on
    first use); every other call, or one with options a zygote does not reproduce, runs as a real subprocess."""

    def __init__(self, real, folder: Path) -> None:
        self.real, self.folder = real, Path(folder)
        self.zygotes: dict[tuple, Zygote] = {}
        self.warm = 0

    def __call__(self, args, *a, **kw):
        kind = kind_of(args)
        plain = not a and set(kw) <= {"capture_output", "text", "timeout", "env", "stdin", "cwd"} and kw.get("capture_output") \
            and kw.get("text") and kw.get("stdin", subprocess.DEVNULL) == subprocess.DEVNULL
        if kind is None or not plain:
            return self.real(args, *a, **kw)
        env = dict(os.environ if kw.get("env") is None else kw["env"])
        key = (kind, env_key(env))
        zygote = self.zygotes.get(key)
        if zygote is None or zygote.proc.poll() is not None:
            zygote = self.zygotes[key] = Zygote(kind, env, self.folder / f"{kind}-{len(self.zygotes)}")
        self.warm += 1
        return zygote.run(args, timeout=kw.get("timeout"), cwd=kw.get("cwd"))

    def close(self) -> None:
        for zygote in self.zygotes.values():
            zygote.close()


# ---- the zygote process ------------------------------------------------------------------------------------------
def _serve(kind: str) -> None:
    import importlib
    import runpy

    hidden, preload = KINDS[kind]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # as the kind's scripts do first
    for name in preload:
        importlib.import_module(name)
    import gc

    gc.freeze()  # what was imported stays out of the children's collections (fewer copied pages)
    requests, replies = sys.stdin, sys.stdout
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child: the script as `python SCRIPT ARGS` runs it
            code = 1
            try:
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
                os.dup2(os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
                sys.stdin = open(0, closefd=False)
                sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
                os.chdir(request["cwd"])
                sys.argv = list(request["argv"])
                sys.path[0] = str(Path(sys.argv[0]).resolve().parent)  # as for `python SCRIPT`
                try:
                    runpy.run_path(sys.argv[0], run_name="__main__")
                    code = 0
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                    if exc.code is not None and not isinstance(exc.code, int):
                        print(exc.code, file=sys.stderr)
                except BaseException:  # noqa: BLE001 -- as the interpreter reports an uncaught exception
                    import traceback

                    traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        replies.write(f"{pid}\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(f"{os.waitstatus_to_exitcode(status)}\n")
        replies.flush()


if __name__ == "__main__":
    _serve(sys.argv[1])
