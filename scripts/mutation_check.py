"""Does the op-form suite (tests/ops) still catch a broken form? Each mutant below breaks one form of linear
attention in one way (a wrong mask, a wrong chunk boundary, a state not carried, a decay applied twice); the
suite must fail for every one of them.

    python scripts/mutation_check.py [--tests tests/ops] [-k EXPRESSION] [--only NAME]

``-k fast_form_matches_naive`` runs only the covering-grid tests, to show that the grid alone catches each one.

Each mutant is applied to a copy of the package (and of the tests) in a temporary folder that the suite
runs in, first on PYTHONPATH (the checkout is never modified), the suite runs there with ``-x``, and the table says which test caught it.
The unmutated copy runs first and must pass. Takes a few minutes (the suite once per mutant).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the installed layout: edgelin/ with exporters/, runtime/, models/ mapped into it (pyproject's package-dir)
LAYOUT = {"edgelin": "edgelin", "exporters": "edgelin/exporters", "runtime": "edgelin/runtime", "models": "edgelin/models"}

# name -> (file under edgelin/, the exact text, its replacement, what it breaks)
MUTANTS = {
    "chunk-mask-strict": (
        "ops/chunk.py", "causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()",
        "causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)",
        "wrong mask: the chunk form's causal mask drops the diagonal (a token does not see itself)",
    ),
    "decay-mask-future": (
        "ops/common.py", "return torch.where(causal, L, float(\"-inf\"))", "return L",
        "wrong mask: the decay matrix lets the future through (no causal mask before the exp)",
    ),
    "chunk-boundary-inclusive": (
        "ops/chunk.py", "before = torch.cat([torch.zeros_like(x[:, :, :1]), inclusive[:, :, :-1]], dim=2)",
        "before = inclusive",
        "wrong chunk boundary: each chunk starts from a state that already holds its own keys",
    ),
    "decay-window-off-by-one": (
        "ops/common.py", "strict = ones.tril(-1).reshape(n, n, *trailing)", "strict = ones.tril().reshape(n, n, *trailing)",
        "wrong chunk boundary: the decay window includes the key's own step",
    ),
    "chunk-state-not-carried": (
        "ops/chunk.py", "S_before, S_final = _exclusive_cumsum(kv, state[\"S\"])",
        "S_before, S_final = _exclusive_cumsum(kv, torch.zeros_like(state[\"S\"]))",
        "state not carried: the undecayed chunk form ignores the initial S",
    ),
    "decayed-chunk-state-not-carried": (
        "ops/chunk.py", "    S0 = state[\"S\"]  # [B, H, F, Dv]", "    S0 = torch.zeros_like(state[\"S\"])  # [B, H, F, Dv]",
        "state not carried: the decayed chunk form ignores the initial S",
    ),
    "step-decay-twice": (
        "ops/recurrent.py", "        a = g.exp()  # [B, H, 1] or [B, H, 1, F]", "        a = (2 * g).exp()  # [B, H, 1] or [B, H, 1, F]",
        "decay applied twice: the step (decode) form squares the gate",
    ),
    "chunk-decay-twice-across": (
        "ops/chunk.py", "across = relative_log_decay(totals, dim=2).exp()", "across = (2 * relative_log_decay(totals, dim=2)).exp()",
        "decay applied twice: the chunk form decays the carried state twice across chunks",
    ),
}


def shadow(dest: Path) -> Path:
    """The package in its installed layout, the tests and pyproject.toml (the suite's settings) under ``dest``."""
    skip = shutil.ignore_patterns("__pycache__", "*.safetensors")
    for src, dst in LAYOUT.items():
        shutil.copytree(ROOT / src, dest / dst, dirs_exist_ok=True, ignore=skip)
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def run_suite(pythonpath: Path, tests: str, select: str | None = None) -> tuple[bool, str, float]:
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    check = subprocess.run([sys.executable, "-c", "import edgelin; print(edgelin.__file__)"], env=env, capture_output=True, text=True, cwd=pythonpath)
    if not check.stdout.strip().startswith(str(pythonpath)):
        raise SystemExit(f"the shadow copy is not the one imported ({check.stdout.strip() or check.stderr.strip()})")
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", tests, "-x", "-q", "-p", "no:cacheprovider", "--durations=0", "-n", "0", *(["-k", select] if select else [])],
        env=env, capture_output=True, text=True, cwd=pythonpath,
    )
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    return proc.returncode == 0, failed[0] if failed else "", time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", default="tests/ops")
    parser.add_argument("-k", dest="select", help="pytest -k expression: run only the matching tests")
    parser.add_argument("--only", action="append", choices=sorted(MUTANTS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgelin-mutants-") as tmp:
        clean = shadow(Path(tmp) / "clean")
        ok, first, secs = run_suite(clean, args.tests, args.select)
        print(f"{'unmutated':28s} {'passes' if ok else 'FAILS: ' + first} ({secs:.0f} s)", flush=True)
        if not ok:
            return 1
        caught_all = True
        for name in args.only or MUTANTS:
            rel, old, new, what = MUTANTS[name]
            copy = shadow(Path(tmp) / name)
            path = copy / "edgelin" / rel
            text = path.read_text()
            if text.count(old) != 1:
                print(f"{name:28s} NOT APPLIED: the text to mutate is not in edgelin/{rel} exactly once")
                caught_all = False
                continue
            path.write_text(text.replace(old, new))
            ok, first, secs = run_suite(copy, args.tests, args.select)
            caught_all &= not ok
            print(f"{name:28s} {'NOT CAUGHT' if ok else 'caught by ' + first} ({secs:.0f} s) -- {what}", flush=True)
    return 0 if caught_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
